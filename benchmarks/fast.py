"""aiayn.fast's kernels one by one: each fast module against the plain module it replaces, on the
same inputs, in the same run, at 1 and at 2 threads: the measurement a kernel of ``aiayn/fast``
must pass to stay (``KERNELS``; ``compiled-matvec`` skipped by ``--quick`` and ``--no-compiled``).

Plain and fast calls are interleaved for ``--repeats`` rounds of ~20 ms; "plain / fast" above 1 is
the kernel's gain, below 1 the table says **does NOT win**; "falls back" rows run the plain function
behind the fast module's dispatch.

    python -m benchmarks.fast --threads 1,2 --kernels dropout fused-loss
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import ModelConfig, build_model
from aiayn.fast import onednn
from aiayn.fast.attention import MIN_DECODE_QUERIES, fast_attention
from aiayn.fast.block_causal import use_block_causal
from aiayn.fast.dropout import FastDropout
from aiayn.fast.fused_loss import FusedLossLinear
from aiayn.fast.linear import FastLinear
from aiayn.fast.matvec import MatvecLinears, use_eager_transposed, use_matvec, use_transposed
from aiayn.models import ModelOutput
from aiayn.nn.attention import MultiHeadAttention, scaled_dot_product_attention
from aiayn.train.losses import sequence_loss
from benchmarks.common import Timed, footer, header, run_interleaved, table
from benchmarks.peers import Dropouts, LMSize, aiayn_lm_config

FALLS_BACK = "falls back"  # a "fast path" label starting so: the fast module runs the plain function


@dataclass
class Case:
    """One measurement: ``plain()`` and ``fast()`` compute the same thing on the same inputs."""

    name: str
    path: str  # the fast module's path on these inputs
    plain: Callable[[], object]
    fast: Callable[[], object]


def _fast_copy(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """A copy of ``module`` (the same weights, its own tensors and gradients) as class ``cls``,
    the swap ``aiayn.fast.optimize`` makes."""
    twin = copy.deepcopy(module)
    twin.__class__ = cls
    return twin


def _clear_grads(*tensors: Tensor | nn.Module) -> None:
    for t in tensors:
        if isinstance(t, nn.Module):
            t.zero_grad(set_to_none=True)
        else:
            t.grad = None


def linear_onednn_cases(opt: argparse.Namespace) -> Iterator[Case]:
    """FastLinear's oneDNN path, forward + backward, against nn.Linear on the same weights."""
    if opt.quick:
        shapes = [("d256 qkv", 256, 256, 768), ("d256 FFN down", 256, 1024, 256)]
    else:
        shapes = [("decoder bench qkv", 4096, 256, 768), ("decoder bench attn out", 4096, 256, 256),
                  ("decoder bench FFN up", 4096, 256, 1024), ("decoder bench FFN down", 4096, 1024, 256),
                  ("paper-base qkv", 768, 512, 1536), ("paper-base FFN up", 768, 512, 2048),
                  ("paper-base FFN down", 768, 2048, 512)]
    for label, rows, i, o in shapes:
        gen = torch.Generator().manual_seed(opt.seed)
        plain = nn.Linear(i, o)
        fast = _fast_copy(plain, FastLinear)
        x = torch.randn(rows, i, generator=gen).requires_grad_()
        g = torch.randn(rows, o, generator=gen)
        path = "oneDNN" if onednn.use_onednn(x, plain.weight) else f"{FALLS_BACK} (F.linear)"

        def step(layer: nn.Module, x: Tensor = x, g: Tensor = g) -> None:
            layer(x).backward(g)
            _clear_grads(layer, x)

        yield Case(f"{label}: {rows:,} x {i} -> {o}", path,
                   lambda step=step, m=plain: step(m), lambda step=step, m=fast: step(m))


def _decode_layers(opt: argparse.Namespace) -> list[tuple[str, list[tuple[int, int]]]]:
    """(label, [(in, out), ...]): one pass over a model's distinct projections."""
    if opt.quick:
        return [("d256 decoder layer", [(256, 768), (1024, 256)])]
    return [("decode bench model: qkv, out, FFN up, down, head", [(256, 768), (256, 256), (256, 1024),
                                                                 (1024, 256), (256, 8000)]),
            ("SmolLM2 layer: qkv, out, gate+up, down", [(576, 960), (576, 576), (576, 3072), (1536, 576)])]


def linear_transposed_cases(opt: argparse.Namespace) -> Iterator[Case]:
    """FastLinear on a decode step's (rows, 1, i) inputs, no grad, against nn.Linear."""
    rows_list = [1, 2, 16] if opt.quick else [1, 2, 4, 16, 64]
    for label, shapes in _decode_layers(opt):
        gen = torch.Generator().manual_seed(opt.seed)
        plain = [nn.Linear(i, o) for i, o in shapes]
        fast = [_fast_copy(m, FastLinear) for m in plain]
        n_weights = sum(i * o for i, o in shapes)
        for rows in rows_list:
            xs = [torch.randn(rows, 1, i, generator=gen) for i, _ in shapes]
            taken = use_eager_transposed(xs[0], plain[0].weight)
            path = "(W x^T)^T" if taken else f"{FALLS_BACK} (F.linear)"

            def one_pass(layers: list[nn.Module], xs: list[Tensor] = xs) -> list[Tensor]:
                return [layer(x) for layer, x in zip(layers, xs, strict=True)]

            yield Case(f"{label} ({n_weights / 1e6:.1f}M weights), {rows} row{'s' * (rows > 1)}", path,
                       torch.inference_mode()(lambda f=one_pass, m=plain: f(m)),
                       torch.inference_mode()(lambda f=one_pass, m=fast: f(m)))


def _decode_inputs(config: ModelConfig, batch: int, keys: int, seed: int) -> tuple[Tensor, Tensor, Tensor, dict]:
    """The (q, k, v, keyword arguments) a decode step hands its first layer's attention kernel:
    ``keys - 1`` cached tokens, one new one (a model of ``config`` with random weights)."""
    torch.manual_seed(seed)
    model = build_model(config).eval()
    attention = next(m for m in model.modules() if isinstance(m, MultiHeadAttention))
    captured: list[tuple] = []

    def record(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> tuple[Tensor, Tensor | None]:
        if q.shape[2] == 1:
            captured.append((q, k, v, kwargs))
        return scaled_dot_product_attention(q, k, v, **kwargs)

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, config.vocab_size, (batch, keys), generator=gen)
    with torch.inference_mode():
        cache = model.new_cache(batch, config.max_seq_len)
        model(tokens[:, :-1], cache=cache)
        attention.kernel = record
        model(tokens[:, -1:], cache=cache)
    q, k, v, kwargs = captured[0]
    return q, k, v, kwargs


def _attention_path(q: Tensor, k: Tensor, kwargs: dict) -> str:
    """Which of ``fast_attention``'s decode paths these inputs take (its own conditions, in order)."""
    mask = kwargs.get("mask")
    single = (q.shape[2] == 1 and kwargs.get("bias") is None and not kwargs.get("dropout_p")
              and not kwargs.get("need_weights")
              and (mask is None or (mask.dim() == 4 and mask.shape[1:3] == (1, 1))))
    if not single or q.shape[0] * q.shape[1] < MIN_DECODE_QUERIES:
        return f"{FALLS_BACK} (plain function)"
    return "GQA fold + written-out" if q.shape[1] != k.shape[1] else "single query, written-out"


def attention_decode_cases(opt: argparse.Namespace) -> Iterator[Case]:
    mha = aiayn_lm_config(LMSize(n_layers=1), Dropouts())  # the decode benchmark's layout
    gqa = ModelConfig(arch="decoder-only", vocab_size=1000, d_model=576, n_heads=9, n_kv_heads=3, n_layers=1,
                      d_ff=1536, activation="swiglu", norm="rmsnorm", norm_position="pre", positional="rope",
                      bias=False, scale_embeddings=False, tie_output=True, pad_id=None,
                      max_seq_len=512)  # SmolLM2-135M's attention
    if opt.quick:
        settings = [("MHA 4 heads", mha, 16, 64), ("GQA 9/3 heads", gqa, 16, 64)]  # >= MIN_DECODE_QUERIES
    else:  # ~144 keys: the decode benchmark's average (16 + 256 new tokens)
        settings = [("MHA 4 heads (decode bench)", mha, 1, 144), ("MHA 4 heads (decode bench)", mha, 16, 144),
                    ("GQA 9/3 heads (SmolLM2)", gqa, 1, 160), ("GQA 9/3 heads (SmolLM2)", gqa, 16, 160)]
    for label, config, batch, keys in settings:
        q, k, v, kwargs = _decode_inputs(config, batch, keys, opt.seed)
        yield Case(f"{label}, batch {batch}, {keys} keys", _attention_path(q, k, kwargs),
                   torch.inference_mode()(lambda q=q, k=k, v=v, kw=kwargs:
                                          scaled_dot_product_attention(q, k, v, **kw)),
                   torch.inference_mode()(lambda q=q, k=k, v=v, kw=kwargs: fast_attention(q, k, v, **kw)))


def _projected_heads(b: int, t: int, h: int, d_h: int, gen: torch.Generator) -> tuple[Tensor, Callable]:
    """A leaf (b, t, 3 h d_h) fused q/k/v projection output and a function making q, k, v
    (b, h, t, d_h) of it as ``MultiHeadAttention`` does (split, view, transpose)."""
    qkv = torch.randn(b, t, 3 * h * d_h, generator=gen).requires_grad_()

    def heads() -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (x.view(b, t, h, d_h).transpose(1, 2) for x in qkv.split(h * d_h, dim=-1))
        return q, k, v

    return qkv, heads


def _training_attention_cases(opt: argparse.Namespace, shapes: list[tuple[str, int, int, int, int]],
                              dropout_p: float) -> Iterator[Case]:
    for label, b, h, t, d_h in shapes:
        gen = torch.Generator().manual_seed(opt.seed)
        qkv, heads = _projected_heads(b, t, h, d_h, gen)
        grad = torch.randn(b, h, t, d_h, generator=gen)
        q, k, v = heads()
        if dropout_p:
            path = "written-out + 16-bit dropout mask"
        else:
            path = "block causal" if use_block_causal(q, k, v, 0.0) else f"{FALLS_BACK} (SDPA)"

        def step(kernel: Callable, heads: Callable = heads, grad: Tensor = grad, qkv: Tensor = qkv) -> None:
            q, k, v = heads()
            kernel(q, k, v, causal=True, dropout_p=dropout_p)[0].backward(grad)
            qkv.grad = None

        yield Case(f"{label}: {b} x {h} heads x {t} x {d_h}", path,
                   lambda s=step: s(scaled_dot_product_attention), lambda s=step: s(fast_attention))


def attention_block_causal_cases(opt: argparse.Namespace) -> Iterator[Case]:
    shapes = ([("small", 4, 4, 128, 64)] if opt.quick else
              [("decoder bench", 16, 4, 256, 64), ("seq2seq small decoder", 32, 4, 32, 64),
               ("paper-base layer", 1, 8, 512, 64)])
    return _training_attention_cases(opt, shapes, 0.0)


def attention_dropout_cases(opt: argparse.Namespace) -> Iterator[Case]:
    shapes = ([("small", 4, 4, 64, 64)] if opt.quick else
              [("decoder bench", 16, 4, 256, 64), ("seq2seq small decoder", 32, 4, 32, 64)])
    return _training_attention_cases(opt, shapes, 0.1)


def dropout_cases(opt: argparse.Namespace) -> Iterator[Case]:
    shapes = ([(70, 20, 256)] if opt.quick else [(70, 20, 256), (16, 256, 256), (16, 256, 1024)])
    plain = nn.Dropout(0.1).train()
    fast = FastDropout(0.1).train()
    for shape in shapes:
        gen = torch.Generator().manual_seed(opt.seed)
        x = torch.randn(shape, generator=gen).requires_grad_()
        g = torch.randn(shape, generator=gen)

        def step(layer: nn.Module, x: Tensor = x, g: Tensor = g) -> None:
            layer(x).backward(g)
            x.grad = None

        yield Case(" x ".join(str(s) for s in shape), "16-bit mask",
                   lambda s=step: s(plain), lambda s=step: s(fast))


def fused_loss_cases(opt: argparse.Namespace) -> Iterator[Case]:
    shapes = ([("small", 8, 64, 64, 1000)] if opt.quick else
              [("decoder bench", 16, 256, 256, 8000), ("paper-base, 768 real target tokens", 32, 24, 512, 37000)])
    for label, b, t, d, vocab in shapes:
        gen = torch.Generator().manual_seed(opt.seed)
        plain = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            plain.weight.normal_(0.0, 0.02, generator=gen)
        fast = _fast_copy(plain, FusedLossLinear)
        hidden = torch.randn(b, t, d, generator=gen).requires_grad_()  # the final norm's output
        targets = torch.randint(0, vocab, (b, t), generator=gen)
        flat = targets.view(-1)
        size = f"{b * t:,} x {d} -> {vocab:,}"

        def core_plain(plain: nn.Linear = plain, hidden: Tensor = hidden, flat: Tensor = flat) -> None:
            F.cross_entropy(F.linear(hidden.view(-1, hidden.shape[-1]), plain.weight), flat).backward()
            _clear_grads(plain, hidden)

        def core_fast(fast: nn.Module = fast, hidden: Tensor = hidden, flat: Tensor = flat) -> None:
            fast.cross_entropy(hidden.view(-1, hidden.shape[-1]), flat, ignore_index=-100).nll_sum.backward()
            _clear_grads(fast, hidden)

        def trainer(head: nn.Module, hidden: Tensor = hidden, targets: Tensor = targets) -> None:
            sequence_loss(ModelOutput(hidden_rows=hidden, head=head), targets).loss.backward()
            _clear_grads(head, hidden)

        yield Case(f"{label} {size}: cross_entropy vs F.linear + F.cross_entropy", "fused", core_plain, core_fast)
        yield Case(f"{label} {size}: sequence_loss, fused head vs nn.Linear head", "fused",
                   lambda f=trainer, m=plain: f(m), lambda f=trainer, m=fast: f(m))


def compiled_matvec_cases(opt: argparse.Namespace) -> Iterator[Case]:
    """Compiled afresh for every call of this function (once per thread count: Inductor's C++
    kernels are generated for the thread count they were compiled under)."""
    from benchmarks.matvec import Projections, compiled

    layers = 4
    torch.manual_seed(opt.seed)
    model = Projections(d_model=576, d_ff=1536, kv_width=192, n_layers=layers, vocab=None).eval()  # SmolLM2's
    n_weights = sum(lin.weight.numel() for lin in model.linears)

    def with_matvec(xs: list[Tensor]) -> list[Tensor]:
        with MatvecLinears():
            return model(xs)

    for rows in opt.compiled_rows:
        torch._dynamo.reset()  # fresh graphs for this thread count and shape
        gen = torch.Generator().manual_seed(opt.seed)
        xs = [torch.randn(rows, lin.in_features, generator=gen) for lin in model.linears]
        x, w = xs[0], model.linears[0].weight
        path = ("multiply + sum" if use_matvec(x, w) else "(W x^T)^T" if use_transposed(x, w)
                else f"{FALLS_BACK} (F.linear)")
        plain_fn, fast_fn = compiled(model), compiled(with_matvec)
        yield Case(f"SmolLM2 projections x {layers} layers ({n_weights / 1e6:.1f}M weights), "
                   f"{rows} row{'s' * (rows > 1)}", path,
                   lambda f=plain_fn, xs=xs: f(xs), lambda f=fast_fn, xs=xs: f(xs))


KERNELS: dict[str, tuple[Callable[[argparse.Namespace], Iterator[Case]], str]] = {  # in the order they run
    "linear-onednn": (linear_onednn_cases,
                      "FastLinear, oneDNN path: training-size layers, forward + backward (vs nn.Linear)"),
    "linear-transposed": (linear_transposed_cases,
                          "FastLinear, turned-around product (W x^T)^T: decode rows, no grad (vs nn.Linear)"),
    "attention-decode": (attention_decode_cases,
                         "fast_attention, single-query decode paths (vs scaled_dot_product_attention)"),
    "attention-block-causal": (attention_block_causal_cases, "fast_attention, block-causal training path, "
                               "forward + backward (vs SDPA is_causal)"),
    "attention-dropout": (attention_dropout_cases, "fast_attention, attention-weight dropout 0.1, "
                          "forward + backward (vs SDPA's dropout)"),
    "dropout": (dropout_cases, "FastDropout p 0.1, forward + backward (vs nn.Dropout)"),
    "fused-loss": (fused_loss_cases, "FusedLossLinear: output layer + cross-entropy fused, "
                   "forward + backward (vs logits + loss)"),
    "compiled-matvec": (compiled_matvec_cases,
                        "compiled decode step's linear layers, MatvecLinears (vs compiled F.linear)"),
}
ROUND_SECONDS = 0.02  # each timed round runs enough calls to take about this long (--quick: 5 ms)


@dataclass
class Result:
    kernel: str
    case: str
    path: str
    threads: int
    plain: float  # seconds per call (median round)
    fast: float
    spread: float  # the larger (max - min) / median of the two

    @property
    def ratio(self) -> float:
        return self.plain / self.fast

    @property
    def judged(self) -> bool:
        """Whether this row measures a kernel (not a fallback to the plain function)."""
        return not self.path.startswith(FALLS_BACK)


def measure(kernel: str, case: Case, threads: int, *, repeats: int, warmup: int, round_seconds: float) -> Result:
    plain, fast = Timed("plain", case.plain), Timed("fast", case.fast)
    run_interleaved([plain, fast], repeats=repeats, warmup=warmup, round_seconds=round_seconds)
    return Result(kernel, case.name, case.path, threads, plain.median, fast.median, max(plain.spread, fast.spread))


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def verdict(r: Result) -> str:
    if not r.judged:
        return "no kernel (falls back)"
    noise = " (within the spread)" if abs(r.ratio - 1) < r.spread else ""
    return f"wins{noise}" if r.ratio >= 1 else f"**does NOT win**{noise}"


def report_kernel(kernel: str, results: list[Result]) -> None:
    print(f"### {kernel}: {KERNELS[kernel][1]}\n")
    rows = [[r.case, r.path, r.threads, fmt_time(r.plain), fmt_time(r.fast), f"**{r.ratio:.2f}x**",
             f"±{r.spread * 50:.0f}%", verdict(r)] for r in results]
    print(table(["case", "fast path", "threads", "plain / call", "fast / call", "plain / fast", "spread",
                 "verdict"], rows))
    print()


def summary(results: list[Result], kernels: list[str], threads: list[int]) -> None:
    print("### Summary: plain / fast per kernel and thread count (cases where the kernel runs)\n")
    rows, losers = [], []
    for kernel in kernels:
        for n in threads:
            judged = [r for r in results if r.kernel == kernel and r.threads == n and r.judged]
            if not judged:
                continue
            ratios = [r.ratio for r in judged]
            geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
            lost = [r for r in judged if r.ratio < 1]
            losers += lost
            rows.append([kernel, n, len(judged), f"{min(ratios):.2f}x", f"{max(ratios):.2f}x", f"{geo:.2f}x",
                         "wins in every case" if not lost else f"**does NOT win in {len(lost)} of {len(judged)}**"])
    print(table(["kernel", "threads", "cases", "min", "max", "geometric mean", "verdict"], rows))
    print()
    if losers:
        print("Cases where the fast module is slower than the plain one it replaces (plain / fast < 1):\n")
        for r in losers:
            print(f"* {r.kernel}, {r.threads} thread{'s' * (r.threads > 1)}: {r.case} ({r.path}): "
                  f"**{r.ratio:.2f}x** (spread ±{r.spread * 50:.0f}%)")
    else:
        print("Every kernel wins in every measured case, at every thread count measured.")


def parse_threads(text: str) -> list[int]:
    try:
        threads = [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes counts like 1,2; got {text!r}") from None
    if not threads or min(threads) < 1:
        raise argparse.ArgumentTypeError(f"--threads takes counts >= 1 like 1,2; got {text!r}")
    return threads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fast", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=parse_threads, default=[1, 2],
                        help="torch intra-op thread counts, comma-separated (default 1,2)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                        help="which kernels (default all)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="interleaved rounds of plain and fast; the figure is their median (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls of each first (default 2)")
    parser.add_argument("--compiled-rows", type=int, nargs="+", default=[1, 2, 16],
                        help="rows of the compiled-matvec cases (default 1 2 16: each compiles twice per "
                             "thread count)")
    parser.add_argument("--no-compiled", action="store_true", help="skip compiled-matvec (it compiles)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke-test settings: small shapes, 2 rounds, 1 warm-up, 5 ms rounds, no "
                             "compiled-matvec unless named in --kernels (figures are rough)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kernels = list(args.kernels)
    round_seconds = ROUND_SECONDS
    if args.quick:
        args.repeats, args.warmup, round_seconds = min(args.repeats, 2), min(args.warmup, 1), ROUND_SECONDS / 4
        if args.kernels == list(KERNELS):
            kernels.remove("compiled-matvec")
    if args.no_compiled and "compiled-matvec" in kernels:
        kernels.remove("compiled-matvec")
    before = torch.get_num_threads()
    header("aiayn.fast kernels against the plain modules they replace", args)
    results: list[Result] = []
    for kernel in kernels:
        kernel_results: list[tuple[int, Result]] = []
        for n in args.threads:
            torch.set_num_threads(n)
            for index, case in enumerate(KERNELS[kernel][0](args)):
                kernel_results.append((index, measure(kernel, case, n, repeats=args.repeats, warmup=args.warmup,
                                                      round_seconds=round_seconds)))
        kernel_results.sort(key=lambda pair: pair[0])  # stable: each case's thread counts side by side
        report_kernel(kernel, [r for _, r in kernel_results])
        sys.stdout.flush()
        results += [r for _, r in kernel_results]
    summary(results, kernels, args.threads)
    torch.set_num_threads(max(args.threads))
    footer()
    torch.set_num_threads(before)


if __name__ == "__main__":
    main()
