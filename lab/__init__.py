"""
The lab: everything tiny-bgpo has learned to measure beyond the tutorial (bgpo.py).

- estimators.py: the field's other likelihood estimators and their exact moments by enumeration.
- bench_estimators.py: every estimator against exact enumeration (the paper's Fig. 3 in small).
- objectives.py: the field's RL objectives (d1's diffu-GRPO, STP, dTRPO, the trajectory control) as
  bgpo.Objective values, and dTRPO's offline DPO loss.
- rl.py: bgpo.py's RL loop with those objectives and the lab's diagnostics.
- dtrpo_offline.py, bench_memory.py, compare.py (with figures.py), radd.py: dTRPO as published, every
  objective's memory, several runs in one figure, RADD's cached sampler.
README.md in this folder has what each measured; test_*.py its claims, run with the tutorial's tests.
Dependencies run one way: lab -> bgpo -> tiny_dllm, tasks.
"""
