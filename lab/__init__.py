"""
The lab: everything tiny-bgpo has learned to measure beyond the tutorial (bgpo.py).

- estimators.py: the field's other likelihood estimators, the exact ELBO and random-order likelihood,
  and the estimators' exact moments, all by enumeration.
- bench_estimators.py: every estimator against exact enumeration (the paper's Fig. 3 in small).
- objectives.py: the field's RL objectives (d1's diffu-GRPO, STP, dTRPO, the trajectory control) as
  Objective values, and dTRPO's offline DPO loss; sampler.py: generate with random remasking and STP's
  prior and early stop.
- rl.py: bgpo.py's RL loop with its steps made replaceable: those objectives and the lab's diagnostics.
- control.py: the control for RL, SFT continued for the RL run's training time.
- dtrpo_offline.py, bench_memory.py, compare.py (with figures.py), stages.py, radd.py: dTRPO as
  published, every objective's memory, several runs in one figure, one tutorial run's SFT and RL stages
  with its control, RADD's cached sampler.
README.md in this folder has what each measured; test_*.py its claims (helpers in testing.py), run with
the tutorial's tests.
Dependencies run one way: lab -> bgpo -> tiny_dllm, tasks.
"""
import bgpo

# The lab measures in the regime of its README: SFT on fresh demonstrations at every step, then RL with
# the settings of that time. Every lab command starts from these defaults; each is still a flag.
EARLIER_DEFAULTS = {"demos": 0, "temperature": 1.0, "neg_weight": 1.0, "rl_lr": 5e-5, "mc_samples": 16}

def make_parser(prog, description):
    """bgpo.py's flags with the lab's defaults."""
    p = bgpo.make_parser(prog, description)
    p.set_defaults(**EARLIER_DEFAULTS)
    return p
