"""
Toy tasks with verifiable rewards, and the character tokenizer they share.

Three tasks, each a prompt string -> answer string map with a reward that a program can check:

    arithmetic   "482+517="     -> "999"          reward 1 if the sum is exact, else 0
    countdown    "7,3,12:33"    -> "3*7+12" ...   reward 1 if a valid expression hits the target,
                                                  0.1 if well formed but wrong, else 0
    sudoku       "1.3.|..." 4x4 -> 16 digits      reward = fraction of blank cells filled correctly

Countdown and Sudoku are the paper's planning tasks (BGPO Sec. 4; its Sudoku, from d1, an earlier RL
method for dLLMs, is 4x4 too). What shrank is the answer: the model writes the sum, the expression or
the grid alone, with no reasoning, in a completion of 4-16 characters, so that a 0.6M-parameter model
learns them on a CPU.

Simplifications versus the paper:
1. Character-level tokens and fixed-length prompts and completions per task (the paper uses
   LLaDA's BPE tokenizer and 256-token completions with reasoning).
2. The model writes the answer directly, with no chain of thought or answer tags.
3. Rewards are computed from the text up to the first end-of-answer token; the reward functions
   read untrusted model output, so they never eval, cap length and magnitude, and never raise.

Shapes: N strings encoded at once, each padded to a fixed length (a task's prompt_len or gen_len).
"""
import random
import zlib
from dataclasses import dataclass
from fractions import Fraction
from itertools import permutations

import torch

# Tokenizer: one character per token, plus three special tokens with distinct ids ----------------------------

PAD, MASK, EOS = "<pad>", "<mask>", "<eos>"
CHARS = "0123456789+-*/()=,:|."

class Tokenizer:
    """Character tokenizer. PAD fills short prompts (left), MASK is the diffusion noise token,
    EOS ends an answer and fills the rest of the completion (LLaDA's convention)."""

    def __init__(self, chars=CHARS):
        self.itos = [PAD, MASK, EOS] + list(chars)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.mask_id, self.eos_id = 0, 1, 2
        self.vocab_size = len(self.itos)

    def encode(self, text):
        unknown = sorted(set(c for c in text if c not in self.stoi or len(c) != 1))
        if unknown:
            raise ValueError(f"text: characters {unknown} are not in the vocabulary")
        return [self.stoi[c] for c in text]

    def decode(self, ids, stop_at_eos=True):
        """ids -> text. Stops at the first EOS (the answer a reward reads); PAD is dropped and
        MASK is shown as '_'. With stop_at_eos=False, EOS is shown as '$'."""
        out = []
        for i in (ids.tolist() if torch.is_tensor(ids) else ids):
            if i == self.eos_id:
                if stop_at_eos:
                    break
                out.append("$")
            elif i == self.mask_id:
                out.append("_")
            elif i != self.pad_id:
                out.append(self.itos[i])
        return "".join(out)

    def encode_batch(self, texts, length, pad_side):
        """Strings -> (N, length) long tensor. Prompts are left-padded with PAD so the answer
        always starts at the same position; answers are right-padded with EOS."""
        pad = self.pad_id if pad_side == "left" else self.eos_id
        rows = []
        for text in texts:
            ids = self.encode(text)
            if len(ids) > length:
                raise ValueError(f"texts: {text!r} is longer than {length} tokens")
            fill = [pad] * (length - len(ids))
            rows.append(fill + ids if pad_side == "left" else ids + fill)
        return torch.tensor(rows, dtype=torch.long)

TOKENIZER = Tokenizer()

# Shared helpers: seeded sampling, split by hash, safe parsing of untrusted text -----------------------------

MAX_TEXT = 64  # rewards look at no more than this many characters of model output

def _rng(generator_or_seed):
    """A Python RNG from an int seed or a torch.Generator (whose state then advances by one draw)."""
    if isinstance(generator_or_seed, torch.Generator):
        generator = generator_or_seed   # on any device (a GPU's: bgpo.py's SFT on CUDA)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    elif isinstance(generator_or_seed, int):
        seed = generator_or_seed
    else:
        raise ValueError("generator_or_seed: expected an int or torch.Generator, "
                         f"got {type(generator_or_seed).__name__}")
    return random.Random(seed)

SPLITS = ("train", "validation", "test")

def _split_of(key, test_percent, validation_percent):
    """Deterministic split by the hash of a problem's key into 100 buckets: the first test_percent
    are 'test', the next validation_percent 'validation' (for choosing the SFT checkpoint without
    looking at the test set), the rest 'train'. A problem is in exactly one split."""
    bucket = zlib.crc32(key.encode()) % 100
    return ("test" if bucket < test_percent
            else "validation" if bucket < test_percent + validation_percent
            else "train")

def _check_sample_args(n, split):
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive int, got {n!r}")
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")

def _answer_text(completion):
    """The part of a completion a reward reads: up to the first '$' (decoded EOS), capped in length."""
    if not isinstance(completion, str):
        return ""
    return completion[:MAX_TEXT].split("$")[0]

class ParseError(Exception):
    pass

def parse_expression(text, max_len=32, max_abs=10**6):
    """Exact value and numbers of an arithmetic expression over + - * / ( ) and non-negative
    integers, as (Fraction, [ints]). A small recursive-descent parser instead of eval: model
    output is untrusted. Raises ParseError on anything else, a number over 4 digits, or an
    intermediate value over max_abs, so that every call is fast and bounded. A well-formed
    expression that divides by zero has value None: a wrong answer, not an error."""
    if len(text) > max_len or not text:
        raise ParseError("empty or too long")
    pos, numbers, undefined = 0, [], False

    def peek():
        return text[pos] if pos < len(text) else ""

    def check(v):
        if abs(v) > max_abs:
            raise ParseError("magnitude")
        return v

    def expr():  # expr := term (('+'|'-') term)*
        nonlocal pos
        v = term()
        while peek() in ("+", "-"):
            op = peek(); pos += 1
            v = check(v + term() if op == "+" else v - term())
        return v

    def term():  # term := atom (('*'|'/') atom)*
        nonlocal pos, undefined
        v = atom()
        while peek() in ("*", "/"):
            op = peek(); pos += 1
            rhs = atom()
            if op == "/" and rhs == 0:
                undefined, rhs = True, Fraction(1)  # keep parsing: is the rest well formed?
            v = check(v * rhs if op == "*" else v / rhs)
        return v

    def atom():  # atom := integer | '(' expr ')'
        nonlocal pos
        if peek() == "(":
            pos += 1
            v = expr()
            if peek() != ")":
                raise ParseError("missing )")
            pos += 1
            return v
        start = pos
        while pos < len(text) and text[pos] in "0123456789":
            pos += 1
        if pos == start or pos - start > 4:
            raise ParseError("number expected")
        numbers.append(int(text[start:pos]))
        return Fraction(numbers[-1])

    value = expr()
    if pos != len(text):
        raise ParseError("trailing text")
    return (None if undefined else value), numbers

class Task:
    """What every task shares: the tokenizer and its encode/decode. Each task also has prompt_pattern,
    a regular expression that every prompt of the task matches (bgpo.py --prompt checks a user's); it names
    ASCII digits, [0-9], because \\d also matches other scripts' digits, which the tokenizer does not have."""
    tokenizer = TOKENIZER

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode(self, ids, stop_at_eos=True):
        return self.tokenizer.decode(ids, stop_at_eos)

# Task 1: multi-digit addition -------------------------------------------------------------------------------

@dataclass
class Arithmetic(Task):
    """a + b with operands 0-999. The sum is written most-significant digit first, as people
    write it; the digit order made no difference once the ELBO was estimated with the
    low-variance count form."""
    digits: int = 3
    name: str = "arithmetic"
    test_percent: int = 10
    validation_percent: int = 5

    def __post_init__(self):
        self.prompt_len = 2 * self.digits + 2      # "999+999="
        self.gen_len = self.digits + 1             # "1998"
        self.prompt_pattern = rf"[0-9]{{1,{self.digits}}}\+[0-9]{{1,{self.digits}}}="

    def sample(self, n, split, generator_or_seed):
        _check_sample_args(n, split)
        rng, hi = _rng(generator_or_seed), 10**self.digits - 1
        prompts, answers = [], []
        while len(prompts) < n:
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            if _split_of(f"{a}+{b}", self.test_percent, self.validation_percent) == split:
                prompts.append(f"{a}+{b}=")
                answers.append(str(a + b))
        return prompts, answers

    def reward(self, prompt, completion):
        try:
            a, b = prompt.rstrip("=").split("+")
            return 1.0 if _answer_text(completion) == str(int(a) + int(b)) else 0.0
        except (ValueError, AttributeError):
            return 0.0


# Task 2: Countdown with three numbers -----------------------------------------------------------------------

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}

def _countdown_expression(rng, numbers):
    """A random expression using each number once, with the fewest parentheses, and its value
    (or None if it divides inexactly). Shapes: (a op b) op c and a op (b op c)."""
    a, b, c = rng.sample(numbers, 3)
    op1, op2 = rng.choice("+-*/"), rng.choice("+-*/")
    apply = {"+": lambda x, y: x + y, "-": lambda x, y: x - y,
             "*": lambda x, y: x * y, "/": lambda x, y: x / y if y and x % y == 0 else None}
    if rng.random() < 0.5:  # (a op1 b) op2 c
        inner = apply[op1](Fraction(a), Fraction(b))
        value = None if inner is None else apply[op2](inner, Fraction(c))
        left = f"({a}{op1}{b})" if _PREC[op1] < _PREC[op2] else f"{a}{op1}{b}"
        return f"{left}{op2}{c}", value
    inner = apply[op2](Fraction(b), Fraction(c))  # a op1 (b op2 c)
    value = None if inner is None else apply[op1](Fraction(a), inner)
    needs = _PREC[op2] < _PREC[op1] or (op1 in "-/" and _PREC[op1] == _PREC[op2])
    return f"{a}{op1}" + (f"({b}{op2}{c})" if needs else f"{b}{op2}{c}"), value

@dataclass
class Countdown(Task):
    """Three numbers in 1..max_number and a target in 1..max_target; the answer is an expression
    that uses each number exactly once with + - * / and parentheses and equals the target.
    Targets are made by a random expression, so every problem has at least one solution; the
    training answer is that expression, and the reward accepts any correct one."""
    max_number: int = 20
    max_target: int = 100
    name: str = "countdown"
    test_percent: int = 10
    validation_percent: int = 5

    def __post_init__(self):
        self.prompt_len = 12   # "20,20,20:100"
        self.gen_len = 10      # "(20-19)*20" is the longest canonical answer
        self.prompt_pattern = r"[0-9]{1,2},[0-9]{1,2},[0-9]{1,2}:[0-9]{1,3}"

    def sample(self, n, split, generator_or_seed):
        _check_sample_args(n, split)
        rng = _rng(generator_or_seed)
        prompts, answers = [], []
        while len(prompts) < n:
            numbers = [rng.randint(1, self.max_number) for _ in range(3)]
            expr, value = _countdown_expression(rng, numbers)
            if value is None or value.denominator != 1 or not 1 <= value <= self.max_target:
                continue
            prompt = ",".join(map(str, numbers)) + f":{int(value)}"
            key = ",".join(map(str, sorted(numbers))) + f":{int(value)}"
            if _split_of(key, self.test_percent, self.validation_percent) == split:
                prompts.append(prompt)
                answers.append(expr)
        return prompts, answers

    @staticmethod
    def _read(prompt, completion):
        """(sorted prompt numbers, target, the answer's value, the numbers it uses), or None if the
        prompt is malformed or the answer does not parse."""
        try:
            numbers_text, target_text = prompt.split(":")
            numbers, target = sorted(int(s) for s in numbers_text.split(",")), int(target_text)
            return (numbers, target, *parse_expression(_answer_text(completion)))
        except (ValueError, AttributeError, ParseError):
            return None

    def reward(self, prompt, completion):
        read = self._read(prompt, completion)
        if read is None:
            return 0.0
        numbers, target, value, used = read
        return 1.0 if sorted(used) == numbers and value == target else 0.1


# Task 3: 4x4 Sudoku -----------------------------------------------------------------------------------------

def _all_sudoku_grids():
    """All 288 valid 4x4 grids (rows, columns and 2x2 boxes hold 1..4), as 16-char strings, in
    lexicographic order: grown a row at a time, keeping a row when it repeats no digit of its columns
    or of the row above in its boxes."""
    grids = [""]
    for r in range(4):
        grids = [g + "".join(row) for g in grids for row in permutations("1234")
                 if all(row[c] not in g[c::4] for c in range(4))
                 and (r % 2 == 0 or all(set(g[-4:][c:c + 2]).isdisjoint(row[c:c + 2]) for c in (0, 2)))]
    return grids

SUDOKU_GRIDS = _all_sudoku_grids()
# bit n of _HAS[i, d] is set when grid n has digit d at cell i: matching a puzzle is a few ANDs
_HAS = {(i, d): sum(1 << n for n, g in enumerate(SUDOKU_GRIDS) if g[i] == d)
        for i in range(16) for d in "1234"}

def _sudoku_solutions(cells):
    """The valid grids that agree with the given cells ('.' = blank; only the first 16 are read)."""
    match = (1 << len(SUDOKU_GRIDS)) - 1
    for i, c in enumerate(cells[:16]):
        if c != ".":
            match &= _HAS.get((i, c), 0)
    return [g for n, g in enumerate(SUDOKU_GRIDS) if match >> n & 1]

@dataclass
class Sudoku(Task):
    """A 4x4 grid with blanks ('.') and exactly one solution; rows are separated by '|' in the
    prompt. The answer is the full solved grid as 16 digits. Train, validation and test are split
    by solution grid, so no test solution is ever seen in training."""
    min_blanks: int = 10
    max_blanks: int = 12
    name: str = "sudoku"
    test_percent: int = 20
    validation_percent: int = 10

    def __post_init__(self):
        self.prompt_len = 19   # "..31|....|..4.|3.1."
        self.gen_len = 16
        self.prompt_pattern = r"[1-4.]{4}(\|[1-4.]{4}){3}"

    def sample(self, n, split, generator_or_seed):
        _check_sample_args(n, split)
        rng = _rng(generator_or_seed)
        grids = [g for g in SUDOKU_GRIDS if _split_of(g, self.test_percent, self.validation_percent) == split]
        prompts, answers = [], []
        while len(prompts) < n:
            grid = rng.choice(grids)
            blanks = set(rng.sample(range(16), rng.randint(self.min_blanks, self.max_blanks)))
            cells = "".join("." if i in blanks else grid[i] for i in range(16))
            if len(_sudoku_solutions(cells)) == 1:
                prompts.append("|".join(cells[i:i + 4] for i in range(0, 16, 4)))
                answers.append(grid)
        return prompts, answers

    def reward(self, prompt, completion):
        if not isinstance(prompt, str) or len(prompt) != 19:
            return 0.0
        cells = prompt.replace("|", "")
        solutions = _sudoku_solutions(cells)
        blanks = [i for i, c in enumerate(cells) if c == "."]
        if len(solutions) != 1 or not blanks:
            return 0.0
        answer = _answer_text(completion)[:16]
        right = sum(1 for i in blanks if i < len(answer) and answer[i] == solutions[0][i])
        return right / len(blanks)

# The tasks by name, and their token tensors -----------------------------------------------------------------

TASKS = {"arithmetic": Arithmetic, "countdown": Countdown, "sudoku": Sudoku}

def get_task(name):
    if name not in TASKS:
        raise ValueError(f"name: unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]()

def encode(task, prompts, answers=None, device="cpu"):
    """Prompt strings -> (N, P) tokens; answers, if given, -> (N, L) completions: the answer, then EOS tokens
    up to L (an answer of L characters, as every 4x4 Sudoku's, has none)."""
    x = task.tokenizer.encode_batch(prompts, task.prompt_len, "left").to(device)
    if answers is None:
        return x
    return x, task.tokenizer.encode_batch(answers, task.gen_len, "right").to(device)
