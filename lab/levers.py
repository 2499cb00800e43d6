"""
Levers for RL past its SFT model's reach, and for turning reach into answers per second, as options of the
lab's loop (lab.rl):

1. Keep the batch informative: DAPO's dynamic sampling (Yu et al., arXiv 2503.14476, Sec. 3.2). Draw the
   step's prompts and their G rollouts; keep the groups whose rewards differ (the only ones with A != 0);
   while fewer than --prompts-per-step are kept, draw that many fresh prompts again, up to --dynamic-batches
   sampler batches in all. The update sees only kept groups: all of them, when the cap is not reached, and
   fewer (each row's share of the update then larger) when it is. dynamic_rollouts.
2. Explore where the policy has stopped: rollouts from the random-order model at temperature 1, the model
   whose likelihood the ELBO bounds (--remasking random --temperature 1, flags lab.rl already had), so that
   BGPO's on-policy update is the exact ELBO gradient for the model that wrote the rollouts. No code here.
3. Guide where no rollout succeeds: IGPO's inpainting (Zhao et al., arXiv 2509.10396). For each group whose
   G rollouts all fail, one more completion is sampled with part of a known solution fixed in it (the
   sampler's prior: those tokens are in place from the start and never changed) and the rest written by the
   policy; the verifier scores it like any other, and if it solves the problem it replaces the group's last
   rollout (at most one per group). The fraction of the solution's L tokens fixed is drawn per group,
   uniform in HINT_FRACTION; the positions are uniform among the L. IGPO splits a reasoning trace into
   chunks; a Countdown answer has no chunks to split. The update treats a hinted rollout as any other: its
   ELBO covers all L tokens, the hinted ones included. --hints inpaint. hinted_rollouts.
   With --dynamic-batches too, each drawn batch gets its hints before dynamic sampling keeps its mixed
   groups, so a hinted group counts as kept and fewer sampler batches are drawn. --hint-decay scales the
   hinted share down linearly over the run, so that the last steps' rollouts are the policy's own.
   The control, --hints solution: the known solution itself (answer, then end tokens) replaces the last
   rollout of every all-fail group. On-policy, BGPO's gradient on that row is A / L times the gradient of its
   ELBO: SFT's loss on the solution, weighted by its advantage. The question the pair asks: does a masked
   model learn more from solutions it partly wrote itself than from the same solutions given in full?
4. Select before sampling in full: selective rollouts after GRESO (arXiv 2506.02177), whose skip
   rule reads a prompt's history; problems here are fresh each step, so --probe K rollouts of PROBE_POOL
   times the prompts stand in for it, and the prompts whose probes differ (their group is mixed whatever
   follows) are kept first. probed_rollouts.
5. Write the rollouts left to right: JustGRPO (arXiv 2601.15165) finds that confidence-first decoding skips
   the uncertain "fork" tokens and lowers pass@k. --rollout-order left-to-right gives the rollouts' sampler
   one-token blocks, one step each; the greedy evaluations keep the confidence order. No code here.
"""
import torch

from lab.objectives import rows_of
from lab.sampler import Rollouts, sample_rollouts
from tasks import encode

HINT_FRACTION = (0.2, 0.6)   # the share of a known solution's tokens fixed in a hinted rollout
PROBE_POOL = 2               # --probe: candidate prompts drawn per prompt kept

def concat_rollouts(parts):
    """Several Rollouts as one, rows in order."""
    return Rollouts(prompts=[p for part in parts for p in part.prompts],
                    **{name: torch.cat([getattr(part, name) for part in parts])
                       for name in ("x", "y", "commit_steps", "rewards")},
                    texts=[t for part in parts for t in part.texts])

def group_rows(groups, group_size, device):
    """(B,) bool over the rows of whole groups, from a (B / G,) bool over the groups."""
    return groups.to(device).repeat_interleave(group_size)

def dynamic_rollouts(draw, n_prompts, group_size, max_batches):
    """DAPO's dynamic sampling. draw(): a fresh batch of n_prompts prompts x G rollouts (its answers too, as
    sample_step returns them). Keeps the groups whose rewards differ, drawing again until n_prompts are kept
    or max_batches batches were drawn: (the kept Rollouts, their answers, every drawn batch's rewards
    (batches, n_prompts x G), the number of batches drawn). If no batch has a group whose rewards differ,
    the last batch drawn is returned whole (its update is skipped, as the loop skips any all-tied batch)."""
    kept, answers, drawn = [], [], []
    while len(drawn) < max_batches and sum(len(k.prompts) for k in kept) < n_prompts * group_size:
        batch, batch_answers = draw()
        drawn.append(batch.rewards)
        groups = batch.rewards.view(-1, group_size)
        mixed = groups.amax(1) > groups.amin(1)                                       # (n_prompts,)
        room = n_prompts - sum(len(k.prompts) for k in kept) // group_size
        mixed &= mixed.cumsum(0) <= room                                               # the first `room` ones
        kept.append(rows_of(batch, group_rows(mixed, group_size, batch.rewards.device)))
        answers += [a for a, m in zip(batch_answers, mixed.tolist()) if m]
    if not answers:   # no group with a signal in any batch: the last one, whose update will be skipped
        return batch, batch_answers, torch.stack(drawn), len(drawn)
    return concat_rollouts(kept), answers, torch.stack(drawn), len(drawn)

def probed_rollouts(sample, prompts, answers, group_size, n_keep, probe):
    """Selective rollouts (after GRESO, arXiv 2506.02177, whose skip rule reads a prompt's history; problems
    here are fresh each step, so a probe stands in for it): `probe` rollouts of each candidate prompt first.
    A prompt whose probes differ will give a mixed group whatever its other rollouts do: those are kept
    first, then the others in the order drawn, n_keep in all; each kept prompt's group is then completed with
    group_size - probe more rollouts. sample(prompts, k): Rollouts, k a prompt, rows in prompt order.
    Returns (the Rollouts, groups of group_size, a group's probe rows first; the kept prompts' answers; the
    share of kept prompts whose probes differed; the rows sampled over n_keep x group_size)."""
    first = sample(prompts, probe)
    probes = first.rewards.view(-1, probe)
    differ = (probes.amax(1) > probes.amin(1)).tolist()
    kept = sorted(range(len(prompts)), key=lambda i: not differ[i])[:n_keep]       # stable: in draw order
    rest = sample([prompts[i] for i in kept], group_size - probe)
    def rows(batch, start, n):   # rows start .. start + n - 1 of a batch
        index = torch.arange(len(batch.prompts))
        return rows_of(batch, (index >= start) & (index < start + n))
    more = group_size - probe
    parts = [part for j, i in enumerate(kept)
             for part in (rows(first, i * probe, probe), rows(rest, j * more, more))]
    sampled = len(prompts) * probe + len(kept) * more
    return (concat_rollouts(parts), [answers[i] for i in kept], sum(differ[i] for i in kept) / len(kept),
            sampled / (n_keep * group_size))

def hint_prior(task, answers, generator, mask_id, scale=1.0):
    """(N, L) token ids: each known answer's completion (answer, then end tokens) with a fraction of its L
    positions, uniform in HINT_FRACTION per row times scale (--hint-decay lowers it over the run; one token
    at least), kept, and MASK at the others (the sampler's prior)."""
    _, solution = encode(task, [""] * len(answers), answers)
    N, L = solution.shape
    low, high = HINT_FRACTION
    fraction = scale * (low + (high - low) * torch.rand(N, generator=generator))
    n_hinted = (fraction * L).round().long().clamp(1, L - 1)                              # (N,)
    rank = torch.rand(N, L, generator=generator).argsort(1).argsort(1)                   # a random order
    return solution.masked_fill(rank >= n_hinted[:, None], mask_id)

def hinted_rollouts(model, task, batch, answers, group_size, args, generator, mode, scale=1.0, **options):
    """For each group of batch whose G rewards are all below 1, a solved completion in place of its last
    rollout: mode "inpaint", one rollout sampled with part of the known answer fixed (hint_prior), kept
    only if the verifier says it solves; mode "solution", the known answer itself. answers: the known
    answer of each group's prompt. Returns (the new Rollouts, (B / G,) bool: the groups that got one,
    (B / G,) bool: the groups that asked for one)."""
    groups = batch.rewards.view(-1, group_size)
    failed = (groups < 1).all(1)                                                      # (B / G,)
    if not failed.any():
        return batch, torch.zeros_like(failed), failed
    which = failed.nonzero()[:, 0].tolist()
    prompts = [batch.prompts[i * group_size] for i in which]
    known = [answers[i] for i in which]
    if mode == "inpaint":
        prior = hint_prior(task, known, generator, model.config.mask_id, scale)
        hinted = sample_rollouts(model, task, prompts, 1, args, generator, prior=prior,
                                 **{k: v for k, v in options.items() if k != "prior"})
    elif mode == "solution":
        x, y = encode(task, prompts, known, device=args.device)
        texts = [task.decode(ids) for ids in y.cpu()]
        hinted = Rollouts(prompts, x, y, torch.full_like(y, -1), texts,
                          torch.tensor([task.reward(p, t) for p, t in zip(prompts, texts)]))
    else:
        raise ValueError(f"mode: expected 'inpaint' or 'solution', got {mode!r}")
    got = torch.zeros_like(failed)
    y, commit_steps, rewards, texts = (batch.y.clone(), batch.commit_steps.clone(), batch.rewards.clone(),
                                       list(batch.texts))   # the prompts stay: x is batch.x
    for j, i in enumerate(which):
        if hinted.rewards[j] == 1.0:
            row = (i + 1) * group_size - 1                                # the group's last rollout
            y[row], commit_steps[row], rewards[row], texts[row] = (hinted.y[j].to(y.device),
                                                                   hinted.commit_steps[j].to(y.device),
                                                                   hinted.rewards[j], hinted.texts[j])
            got[i] = True
    return Rollouts(list(batch.prompts), batch.x, y, commit_steps, texts, rewards), got, failed
