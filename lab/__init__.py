"""
The lab: everything tiny-bgpo has learned to measure beyond the tutorial (bgpo.py).

- estimators.py: the field's other likelihood estimators, the exact ELBO and random-order likelihood,
  and the estimators' exact moments, all by enumeration.
- bench_estimators.py: every estimator against exact enumeration (the paper's Fig. 3 in small).
- objectives.py: the field's RL objectives (d1's diffu-GRPO, STP, dTRPO, the trajectory control) as
  Objective values, and dTRPO's offline DPO loss; sampler.py: generate with random remasking and STP's
  prior and early stop, and the lab's rollouts and evaluation.
- rl.py: a copy of bgpo.py's RL loop with those objectives, the lab's options and its diagnostics.
- control.py: the control for RL, SFT continued for the RL run's training time.
- dtrpo_offline.py, bench_memory.py, compare.py (with figures.py), stages.py, phases.py, offpolicy.py,
  radd.py: dTRPO as published, every objective's memory, several runs in one figure, one tutorial run's SFT
  and RL stages with its control, where one tutorial run's seconds go, how far off-policy the paper's second
  mini-batch is, RADD's cached sampler.
- cli.py: the lab's command line: bgpo.py's flags and the lab's, whose defaults are bgpo.py's.
README.md in this folder has what each measured; test_*.py its claims (helpers in testing.py), run with
the tutorial's tests.
Dependencies run one way: lab -> bgpo -> tiny_dllm, tasks. The lab has one default regime, the tutorial's.
"""
