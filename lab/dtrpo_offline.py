"""
dTRPO as published, in small: offline DPO on trajectories ("Trajectory Reduction in Policy
Optimization of Diffusion LLMs", 2026), from the SFT model's own solved and unsolved rollouts.

    python -m lab.dtrpo_offline [any bgpo.py or lab flag for the model, sampler and evaluation]

The loss is lab.objectives.dtrpo_dpo_loss: each log-ratio against the frozen SFT model is estimated
with one sampler step per block. Each epoch prints the exact trajectory margin on the pairs (every
step, lab.estimators.trajectory_log_likelihood), the quantity the estimate stands for.
"""
import copy

import torch

import bgpo
from bgpo import test_problems
from lab import cli
from lab.estimators import dtrpo_log_likelihood, trajectory_log_likelihood
from lab.objectives import dtrpo_dpo_loss
from lab.sampler import evaluate, sample_rollouts
from tasks import get_task

def offline_dtrpo(args, task, model, n_prompts=512, epochs=4, batch=32, beta=0.1, lr=5e-5):
    """dTRPO as published, in small (python -m lab.dtrpo_offline): the SFT model samples G
    completions of n_prompts training problems, recording their commit steps; each group gives
    min(#solved, #not solved) pairs of a solved (reward 1) and an unsolved completion; dtrpo_dpo_loss
    trains the model on them against the frozen SFT model. Each epoch prints the exact trajectory
    margin on the pairs (every step, trajectory_log_likelihood), the quantity the one-step-per-block
    estimate stands for, and the progress accuracy."""
    generator = torch.Generator().manual_seed(args.seed + 4)
    eval_prompts = test_problems(task, args)
    prompts = task.sample(n_prompts, "train", generator)[0]
    rollouts = sample_rollouts(model, task, prompts, args.group_size, args, generator)
    x, y, commit, solved = rollouts.x, rollouts.y, rollouts.commit_steps, rollouts.rewards == 1.0
    win, lose = [], []
    # pairs within a prompt's group
    for lo in range(0, len(rollouts.prompts), args.group_size):
        group = torch.arange(lo, lo + args.group_size)
        w, l = group[solved[group]], group[~solved[group]]
        win, lose = win + w[:len(l)].tolist(), lose + l[:len(w)].tolist()
    if not win:
        raise bgpo.RunError(f"the SFT model's {len(rollouts.prompts)} rollouts give no solved/unsolved pair "
                            f"in any group (solved share {solved.float().mean():.3f}): DPO needs both; "
                            "try more --sft-steps")
    win, lose = torch.tensor(win), torch.tensor(lose)
    reference = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def shifts():  # mean exact log-ratio to the reference, T_theta - T_ref, of the solved and the unsolved
        return [float((trajectory_log_likelihood(model, x[i], y[i], commit[i]) -
                       trajectory_log_likelihood(reference, x[i], y[i], commit[i])).mean())
                for i in (win, lose)]

    with torch.no_grad():  # what one step per block sees of the margin log p(w) - log p(l), against all steps
        exact = trajectory_log_likelihood(model, x[win], y[win], commit[win]) - \
            trajectory_log_likelihood(model, x[lose], y[lose], commit[lose])
        one = dtrpo_log_likelihood(model, x[win], y[win], commit[win], args.block_len, generator) - \
            dtrpo_log_likelihood(model, x[lose], y[lose], commit[lose], args.block_len, generator)
    result = {"pairs": len(win),
              "accuracy": [evaluate(model, task, eval_prompts, args, n_show=0)["accuracy"]],
              "margin": exact.mean().item(), "margin_sd": exact.std().item(),
              "estimate_sd": (one - exact).std().item()}
    print(f"{len(win)} pairs from {n_prompts} prompts x G = {args.group_size}"
          f" (solved share {solved.float().mean():.3f});"
          f" progress accuracy of the SFT model {result['accuracy'][0]:.1%}")
    print(f"log-likelihood margin of the pairs, solved - unsolved (all steps): mean {result['margin']:+.2f},"
          f" sd {result['margin_sd']:.2f} nats;"
          f" one step per block misses it by {result['estimate_sd']:.2f} nats (sd)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for epoch in range(epochs):
        order = torch.randperm(len(win), generator=generator)
        for i in range(0, len(win), batch):
            w, l = win[order[i:i + batch]], lose[order[i:i + batch]]
            loss = dtrpo_dpo_loss(model, reference, x[w], y[w], commit[w], y[l], commit[l], beta,
                                  args.block_len, generator=generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        (up, down), accuracy = shifts(), evaluate(model, task, eval_prompts, args, n_show=0)["accuracy"]
        result["accuracy"].append(accuracy)
        print(f"epoch {epoch + 1}: exact log-ratio to the SFT model, solved {up:+.3f}, unsolved {down:+.3f}"
              f" (margin {up - down:+.3f}); progress accuracy {accuracy:.1%}")
    return result


def main(argv=None):
    p = cli.make_parser("python -m lab.dtrpo_offline",
                        "dTRPO as published: DPO on the SFT model's solved and unsolved rollouts "
                        "(the SFT model is trained first if --out-dir has none).")
    args = cli.check_args(p, p.parse_args(argv))
    task = get_task(args.task)
    return offline_dtrpo(args, task, bgpo.sft_model(args, task))

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.dtrpo_offline")
