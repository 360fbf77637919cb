"""The training step compiles whole: ``torch._dynamo.explain`` finds no graph break in the trainer's
forward + loss (``aiayn.train.trainer.step_loss``) for any family, padded or not, plain or with
aiayn.fast's CPU kernels, and ``--compile`` trains to the eager run's numbers.

A graph break is where a forward reads a tensor's value back into Python (``int(t.max())``,
``bool(mask.all())``): on a GPU it is also a host-device sync. The data checks that need such reads
run eager on the CPU only (``aiayn.nn.data_checks.reads_data``); inside a compiled graph the masks
are always built and the index bounds are Inductor's.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch import Tensor, nn

from aiayn.config import TrainConfig
from aiayn.fast import optimize
from aiayn.models import build_model
from aiayn.models.presets import get_preset
from aiayn.tasks.copy import CopyTask
from aiayn.tasks.reverse import ReverseTask
from aiayn.train.losses import IGNORE
from aiayn.train.task import Batch
from aiayn.train.trainer import step_loss, train

CPU = torch.device("cpu")
PAD = 0


class PresetTask:
    """The Task interface's ``forward`` for a preset model on made-up tokens (id 0 is padding)."""

    def __init__(self, arch: str) -> None:
        self.arch = arch

    def forward(self, model: nn.Module, batch: Batch) -> tuple[object, Tensor]:
        tokens, targets = batch["tokens"], batch["targets"]
        output = model(tokens, tokens) if self.arch == "encoder-decoder" else model(tokens)
        return (output.logits if self.arch == "encoder-only" else output), targets


def preset_batch(padded: bool, vocab: int = 99) -> Batch:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (4, 12), generator=generator)  # (b, t)
    if padded:
        tokens[0, -3:] = PAD
        tokens[2, -7:] = PAD
    return {"tokens": tokens, "targets": tokens.masked_fill(tokens == PAD, IGNORE)}


def graph_breaks(task: object, model: nn.Module, batch: Batch) -> list[str]:
    """Where dynamo breaks the graph of one training step (empty: one graph)."""
    dynamo.reset()

    def step(batch: Batch) -> Tensor:
        return step_loss(task, model, batch, device=CPU, label_smoothing=0.1)[0]  # type: ignore[arg-type]

    explained = dynamo.explain(step)(batch)
    dynamo.reset()
    return [f"{reason.reason.splitlines()[0]} at {reason.user_stack[-1].filename}:{reason.user_stack[-1].lineno}"
            if reason.user_stack else reason.reason for reason in explained.break_reasons]


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny", "llama-tiny", "bert-tiny"])
def test_the_training_step_of_every_family_is_one_graph(preset: str, padded: bool, fast: bool) -> None:
    config = get_preset(preset, pad_id=PAD)
    torch.manual_seed(0)
    model = build_model(config).train()
    if fast:
        optimize(model, mode="train")
    assert graph_breaks(PresetTask(config.arch), model, preset_batch(padded)) == []


@pytest.mark.parametrize("task", [ReverseTask(n_train=64, n_val=8, n_test=8), CopyTask(n_train=64, n_val=8, n_test=8)],
                         ids=["reverse", "copy"])
def test_the_training_step_of_real_tasks_is_one_graph(task: ReverseTask | CopyTask) -> None:
    task.prepare(0)
    model = task.build_model(task.model_config()).train()
    optimize(model, mode="train")
    batch = task.collate("train", task.train_batches(0, 16, 0)[0])
    assert graph_breaks(task, model, batch) == []


def test_the_padding_free_forward_is_eager_on_the_cpu_only() -> None:
    """Padding-free packs the real tokens (their count sets the shapes): the compiled graph runs
    the dense, masked forward instead, which gives the same loss."""
    config = get_preset("gpt-tiny", pad_id=PAD, padding_free=True)
    torch.manual_seed(0)
    model = build_model(config).eval()
    task, batch = PresetTask(config.arch), preset_batch(padded=True)
    assert graph_breaks(task, model, batch) == []
    eager = step_loss(task, model, batch, device=CPU)  # type: ignore[arg-type]
    compiled = torch.compile(step_loss, backend="eager")(task, model, batch, device=CPU)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)


def test_compiled_training_matches_eager(tmp_path) -> None:
    """``train(..., compile=True)``: the whole step compiled, the same losses as eager up to
    float rounding and the same accuracy."""
    results = {}
    for compiled in (False, True):
        task = ReverseTask(n_train=256, n_val=32, n_test=32)
        cfg = TrainConfig(**{**task.train_overrides(), "max_steps": 12, "batch_size": 32, "eval_every": 1000,
                             "log_every": 4, "compile": compiled})
        results[compiled] = train(task, task.model_config(), cfg, tmp_path / str(compiled), progress=False,
                                  make_plots=False, echo=lambda _: None)
    eager, compiled_run = results[False], results[True]
    assert compiled_run.step == eager.step == 12
    assert compiled_run.final_loss == pytest.approx(eager.final_loss, rel=1e-4)
    for key, value in eager.test_metrics.items():
        assert compiled_run.test_metrics[key] == pytest.approx(value, rel=1e-3, abs=1e-3), key


def breaks_of(fn: object, *args: object) -> list[str]:
    dynamo.reset()
    explained = dynamo.explain(fn)(*args)
    dynamo.reset()
    return [reason.reason.splitlines()[0] for reason in explained.break_reasons]


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_the_decode_step_of_a_decoder_is_one_graph(preset: str) -> None:
    """A padded prompt prefilled eagerly, then the one-token step traced: no graph break."""
    from aiayn.generate.step import decode_step

    torch.manual_seed(0)
    model = build_model(get_preset(preset, pad_id=PAD)).eval()
    prompt = torch.randint(1, 99, (2, 5))
    prompt[0, :2] = PAD  # left padding
    with torch.no_grad():
        cache = model.new_cache(2, 16)
        decode_step(model, prompt, cache, valid=prompt != PAD)
        step = prompt[:, -1:]

        def one_step(tokens: Tensor) -> Tensor:
            return decode_step(model, tokens, cache)

        assert breaks_of(one_step, step) == []


def test_the_decode_step_of_an_encoder_decoder_is_one_graph() -> None:
    from aiayn.generate.step import decode_step

    torch.manual_seed(0)
    model = build_model(get_preset("tiny", pad_id=PAD)).eval()
    src = torch.randint(1, 99, (2, 6))
    src[1, -3:] = PAD  # a padded source
    with torch.no_grad():
        encoded = model.encode(src)
        cache = model.new_cache(2, 16)
        bos = torch.ones(2, 1, dtype=torch.long)
        decode_step(model, bos, cache, memory=encoded.memory, memory_valid=encoded.valid)  # fills cross k/v

        def one_step(tokens: Tensor) -> Tensor:
            return decode_step(model, tokens, cache, memory_valid=encoded.valid)

        assert breaks_of(one_step, bos) == []
