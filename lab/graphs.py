"""
The rollouts' sampler as one CUDA graph: LLaDA's sampler (tiny_dllm.generate) captured once for a batch shape,
then replayed. An eager call issues about a hundred kernels a sampler step from Python (a thousand for
Countdown's ten steps), a few microseconds of the host's time each, while the GPU does little more; a replay
launches the same kernels at once. gpt-fast gets its decoding speed the same way (torch.compile's
"reduce-overhead" captures such a graph), but compile cannot trace a draw from a torch.Generator, which the
sampler's Gumbel noise needs: this captures by hand.

What makes the sampler capturable: every shape is fixed (top-k and scatter commit a fixed count a step) and
nothing reads a device value on the host (a capture refuses an op that would). A replay reads the weights
where they are, so the optimizer's in-place updates reach it; the prompts are copied into the captured input,
and the completions copied out. The generator is registered with the graph (by hand before PyTorch 2.14, by
the capture itself since), so each replay draws the next random numbers, as the next eager call would: the
graph's rollouts are the eager sampler's, bit for bit (test_commands.py checks it where CUDA is). CUDA only;
bgpo.py samples eagerly until the GPU measures this.
"""
import torch

from tiny_dllm import generate

class GraphedSampler:
    """sampler(prompts) == generate(model, prompts, gen_len, temperature=temperature, generator=generator),
    for (B, P) prompts on CUDA, replayed from a CUDA graph captured at the first call (and again at a new
    shape), with the passes under bf16 autocast as bgpo.autocast has them where dtype is "bfloat16"."""

    def __init__(self, model, gen_len, temperature, generator, dtype="float32"):
        if generator.device.type != "cuda":
            raise ValueError(f"generator: a CUDA graph draws on the GPU, not on {generator.device}")
        self.model, self.gen_len, self.temperature, self.generator = model, gen_len, temperature, generator
        self.dtype, self.graph, self.captures = dtype, None, 0

    def sample(self, prompts):
        # autocast's cache of cast weights would keep the capture's casts: off, as PyTorch asks of a capture
        cast = torch.autocast("cuda", torch.bfloat16, enabled=self.dtype == "bfloat16", cache_enabled=False)
        with cast:
            return generate(self.model, prompts, self.gen_len, temperature=self.temperature,
                            generator=self.generator)

    def capture(self, prompts):
        """One eager call on a side stream first (CUDA's rule for a capture: the allocator and the kernels'
        first calls settle outside it), then the capture; the generator is set back before each, so the
        first replay draws what the first eager call would have."""
        torch.cuda.synchronize(prompts.device)   # a graph replaced at a new shape: its replays are done
        self.prompts, state = prompts.clone(), self.generator.get_state()
        side = torch.cuda.Stream(prompts.device)
        side.wait_stream(torch.cuda.current_stream(prompts.device))
        with torch.cuda.stream(side):
            self.sample(self.prompts)
        torch.cuda.current_stream(prompts.device).wait_stream(side)
        self.generator.set_state(state)
        self.graph = torch.cuda.CUDAGraph()
        if torch.__version__ < (2, 14):   # from 2.14 a generator a capture draws from registers itself
            self.graph.register_generator_state(self.generator)   # each replay: the generator's next numbers
        with torch.cuda.graph(self.graph):
            self.completions = self.sample(self.prompts)       # (B, L), the graph's output buffer
        self.generator.set_state(state)
        self.captures += 1

    def __call__(self, prompts):
        if self.graph is None or prompts.shape != self.prompts.shape:
            with torch.cuda.device(prompts.device):   # a capture records on the current device's streams
                self.capture(prompts)
        self.prompts.copy_(prompts)
        self.graph.replay()
        return self.completions.clone()   # the next replay overwrites the buffer
