"""
The control for RL: SFT continued from the SFT model that RL started from, on the same demonstrations
and SFT's own learning-rate schedule, for as many training seconds as the RL run took (its log's
seconds; evaluations excluded on both sides). If RL beats this, it did more than more training would.

    python -m lab.control [the RL run's flags]

Writes control.jsonl (step, seconds, held-out accuracy and reward; 8 evaluations) in the run's folder.
"""
import json
import os
import time

import torch

from bgpo import SFT_LR, held_out, load_checkpoint, load_model, sft_batches, sft_lr_at, sft_path
from lab import cli
from lab.sampler import evaluate
from tasks import get_task
from tiny_dllm import sft_loss

def sft_step(model, optimizer, x, y, lr, generator):
    """One step of bgpo.run_sft's loop (a copy): set the learning rate, the SFT loss, backward, clip, step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = sft_loss(model, x, y, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()

def run_control(args, task):
    run_dir = os.path.join(args.out_dir, args.run_name)
    records = [json.loads(line) for line in open(os.path.join(run_dir, "log.jsonl"))]
    budget = sum(r.get("seconds", 0.0) for r in records)
    start = step = load_checkpoint(sft_path(args), task)["step"]
    model = load_model(sft_path(args), task, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.01)
    generator, test_prompts = torch.Generator().manual_seed(args.seed + 2), held_out(task, args)
    batches, spent = sft_batches(task, args, generator), 0.0
    result = evaluate(model, task, test_prompts, args)
    print(f"control: SFT continued from step {start} for the {budget:.0f} s of training that "
          f"{args.run_name} took\n"
          f"SFT step {step:5d} | held-out accuracy {result['accuracy']:5.1%} "
          f"(reward {result['reward']:.3f}) | 0 s")
    curve = [{"step": step, "seconds": 0.0, "accuracy": result["accuracy"], "reward": result["reward"]}]
    next_eval = budget / 8
    while spent < budget:
        t0, step = time.time(), step + 1
        sft_step(model, optimizer, *next(batches), sft_lr_at(args, step), generator)
        spent += time.time() - t0
        if spent >= min(next_eval, budget):  # 8 evaluations, spread over the time budget
            result, next_eval = evaluate(model, task, test_prompts, args), next_eval + budget / 8
            curve.append({"step": step, "seconds": spent, "accuracy": result["accuracy"],
                          "reward": result["reward"]})
            print(f"SFT step {step:5d} | held-out accuracy {result['accuracy']:5.1%} "
                  f"(reward {result['reward']:.3f}) | {spent:.0f} s")
    with open(os.path.join(run_dir, "control.jsonl.tmp"), "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in curve)
    os.replace(os.path.join(run_dir, "control.jsonl.tmp"), os.path.join(run_dir, "control.jsonl"))
    rl = [r for r in records if "accuracy" in r]
    for name, accuracy in (("SFT model", curve[0]["accuracy"]),
                           (f"SFT continued, {step - start} steps", curve[-1]["accuracy"]),
                           (f"SFT + RL, {rl[-1]['step']} RL steps", rl[-1]["accuracy"])):
        print(f"{name:>32} {accuracy:>6.1%}")
    print(f"written to {os.path.join(run_dir, 'control.jsonl')}")
    return curve

def main(argv=None):
    p = cli.make_parser("python -m lab.control", __doc__.strip().split("\n\n")[0])
    args = cli.check_args(p, p.parse_args(argv))
    log = os.path.join(args.out_dir, args.run_name, "log.jsonl")
    if not os.path.isfile(log):
        p.error(f"the control runs for as long as the RL run did: no RL log at {log}")
    task = get_task(args.task)
    print(f"task {task.name} | device {args.device} | seed {args.seed}")
    return run_control(args, task)

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.control")
