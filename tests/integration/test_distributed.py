"""Multi-process training on the CPU (gloo): DDP equals one process on the union of the ranks'
batches; FSDP trains alike and its checkpoint loads into a single-process model.

Same global batch: rank r of a 2-process run takes batches r::2 of each step's window, so the
single-process reference (``UnionReverse``, ``UnionCopy``) trains on the concatenation of each window's batches.
The ranks' batches differ in size at the last step (16 and 10 examples): the trainer weights each
rank's loss by its share of the step's tokens, so the averaged gradient is the union's token-mean.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker as dw

from aiayn.train import checkpoint as ckpt
from aiayn.train.trainer import train

pytestmark = pytest.mark.slow


def train_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv", newline="") as handle:
        return [float(r["train_loss"]) for r in csv.DictReader(handle) if r["train_loss"]]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None and latest.name == "step-00000008"
    return load_file(str(latest / ckpt.MODEL_FILE))


_REFERENCES: dict[tuple, Path] = {}


def single_process(tmp_path_factory, task: str = "reverse", **train_kw) -> Path:
    """One process, one global batch (the union of the 2 ranks' batches) per micro-batch."""
    key = (task, *sorted(train_kw.items()))
    if key not in _REFERENCES:
        run_dir = tmp_path_factory.mktemp("single") / "run"
        union = dw.small_task(task, union=True)
        train(union, dw.small_model(union), dw.small_train(**train_kw), run_dir, progress=False,
              make_plots=False)
        _REFERENCES[key] = run_dir
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return single_process(tmp_path_factory)


def assert_same_run(run_dir: Path, reference: Path, *, atol: float) -> None:
    got, want = train_losses(run_dir), train_losses(reference)
    assert len(got) == len(want) == 8
    # metrics.csv holds 6 significant digits: equal within 1e-5 relative.
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    final = json.loads((run_dir / "rank0.json").read_text())["final_loss"]
    assert final == pytest.approx(json.loads((reference / "summary.json").read_text())["final_train_loss"],
                                  abs=1e-5)
    w, w_ref = weights(run_dir), weights(reference)
    assert w.keys() == w_ref.keys()
    for name in w:
        a, b = w[name], w_ref[name]
        if name.endswith("qkv_proj.bias"):
            # The key bias gets a zero gradient in exact arithmetic (softmax is shift-invariant per
            # query), so Adam turns rounding noise (~1e-9) into +-lr steps whose signs depend on the
            # summation order. Its slice [d, 2d) is left out; q and v biases are compared.
            d = a.shape[0] // 3
            a, b = torch.cat([a[:d], a[2 * d :]]), torch.cat([b[:d], b[2 * d :]])
        elif name.endswith("kv_proj.bias"):  # cross-attention's fused key/value bias: the same for its key half
            d = a.shape[0] // 2
            a, b = a[d:], b[d:]
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=name)


def test_ddp_two_processes_equal_one_process_on_the_union(tmp_path, reference):
    run_dir = tmp_path / "ddp"
    dw.spawn(2, run_dir)
    assert_same_run(run_dir, reference, atol=1e-5)
    # Only rank 0 wrote: one metrics file, one set of checkpoints (steps 4 and 8).
    assert [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")] == ["step-00000004", "step-00000008"]


def test_ddp_with_gradient_accumulation_and_adamw(tmp_path, tmp_path_factory):
    """grad_accum 2 (DDP's no_sync on the first micro-batch) and AdamW's parameter groups, which
    leave out frozen parameters: the checkpoint's optimiser state must still be one process's."""
    # lr 1e-3: Adam divides by sqrt(v), so an element whose gradient is near zero turns a
    # rounding-level difference in summation order into a visible part of an lr-sized step
    # (at lr 3e-3 one of 1,024 out_proj elements ends 1.1e-5 away after 8 steps).
    kw = dict(grad_accum=2, optimizer="adamw", weight_decay=0.1, lr=1e-3)
    run_dir = tmp_path / "ddp"
    dw.spawn(2, run_dir, **kw)
    reference = single_process(tmp_path_factory, **kw)
    assert_same_run(run_dir, reference, atol=1e-5)
    task = dw.small_task()
    states = [ckpt.load_checkpoint(ckpt.latest_checkpoint(d / "checkpoints"),
                                   task.build_model(dw.small_model(task))).optimizer_state
              for d in (run_dir, reference)]
    assert [len(g["params"]) for g in states[0]["param_groups"]] == \
        [len(g["params"]) for g in states[1]["param_groups"]]


def test_fsdp_trains_like_one_process_and_saves_a_full_checkpoint(tmp_path, reference):
    run_dir = tmp_path / "fsdp"
    dw.spawn(2, run_dir, fsdp=True)
    assert_same_run(run_dir, reference, atol=1e-5)
    # The full checkpoint loads into a plain single-process model (and its optimiser).
    task = dw.small_task()
    model = task.build_model(dw.small_model(task))
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir / "checkpoints"), model)
    single = ckpt.load_checkpoint(ckpt.latest_checkpoint(reference / "checkpoints"),
                                  task.build_model(dw.small_model(task)))
    assert loaded.optimizer_state is not None and single.optimizer_state is not None
    assert loaded.optimizer_state["state"].keys() == single.optimizer_state["state"].keys()
    for index, entries in single.optimizer_state["state"].items():
        torch.testing.assert_close(loaded.optimizer_state["state"][index]["exp_avg"], entries["exp_avg"],
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_fused_output_layer_loss_trains_alike_under_ddp_and_fsdp(tmp_path, tmp_path_factory, fsdp):
    """The copy task's encoder-decoder is given its targets and runs its (tied) output layer fused
    with the label-smoothed loss, inside the wrapped forward: 2 ranks equal one process."""
    kw = dict(label_smoothing=0.1)
    run_dir = tmp_path / "run"
    dw.spawn(2, run_dir, fsdp=fsdp, task="copy", **kw)
    assert_same_run(run_dir, single_process(tmp_path_factory, task="copy", **kw), atol=1e-5)


def test_tensor_parallel_two_processes_equal_one_process(tmp_path):
    dw.spawn_tp(2, tmp_path)
    results = json.loads((tmp_path / "tp.json").read_text())
    for name in ("llama", "paper"):
        r = results[name]
        assert r["out_err"] <= 1e-5 * max(1.0, r["scale"]), (name, r)
        assert r["grad_err"] <= 1e-6, (name, r)
    assert results["llama"]["local_heads"] == [2, 1]  # 4 heads, 2 kv heads over 2 ranks
    assert results["paper"]["local_heads"] == [2, 2]
    assert "does not split the per-head alibi bias" in results["alibi"]


def test_fsdp_resume_from_its_full_checkpoint(tmp_path, tmp_path_factory):
    """4 sharded steps, then 4 more resumed from the step-4 checkpoint (weights, Adam moments
    re-sharded): the same run as 8 steps of one process. A constant schedule, so the two halves'
    learning rates do not depend on the run's length."""
    kw = dict(schedule="constant")
    run_dir = tmp_path / "fsdp"
    dw.spawn(2, run_dir, fsdp=True, max_steps=4, **kw)
    dw.spawn(2, run_dir, fsdp=True, resume=True, **kw)
    assert_same_run(run_dir, single_process(tmp_path_factory, **kw), atol=1e-5)


def test_ddp_resumed_mid_row_writes_the_rows_of_one_uninterrupted_process(tmp_path, tmp_path_factory):
    """Checkpoints every 2 steps, metrics rows every 3: resumed from step 4, the row of steps 4-6
    starts half filled. The checkpoint holds that half row summed over the ranks, so the resumed
    2-process run writes the single process's rows (loss, NLL and accuracy over the whole row)."""
    kw = dict(log_every=3, save_every=2, keep_checkpoints=4)
    run_dir = tmp_path / "ddp"
    dw.spawn(2, run_dir, **kw)
    for name in ("step-00000006", "step-00000008"):  # as if killed right after step 4's checkpoint
        shutil.rmtree(run_dir / "checkpoints" / name)
    dw.spawn(2, run_dir, resume=True, **kw)

    def rows(run: Path) -> list[list[float]]:
        with open(run / "metrics.csv", newline="") as handle:
            return [[float(r[k]) for k in ("step", "train_loss", "train_nll", "train_acc")]
                    for r in csv.DictReader(handle) if r["train_loss"]]

    got, want = rows(run_dir), rows(single_process(tmp_path_factory, **kw))
    assert [r[0] for r in got] == [r[0] for r in want] == [3, 6, 8]
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_ddp_reads_the_device_at_metrics_rows_and_checkpoints_only(tmp_path):
    """Every read of a tensor's value by the training loop (a host-device sync on a GPU), noted per
    rank: 4 steps with one metrics row and checkpoint, and 8 steps with one, read the same, so no
    step between rows reads anything (the token counts, the weights, the step's loss stay on the
    device; the ranks vote on stopping at the row)."""
    reads = {}
    for steps in (4, 8):
        run_dir = tmp_path / f"steps-{steps}"
        dw.spawn(2, run_dir, max_steps=steps, log_every=steps, save_every=steps, count_reads=True)
        reads[steps] = [sorted(json.loads((run_dir / f"reads-rank{rank}.json").read_text())) for rank in (0, 1)]
    assert reads[4] == reads[8]
    assert reads[4][0] == reads[4][1]  # both ranks alike
    assert any("metrics.py:fold" in read for read in reads[4][0])  # the row's one read of the sums
    assert not any(("trainer.py" in read or "loop.py" in read) and "__int__" in read for read in reads[4][0])


def torchrun(*args: str, nproc: int = 2, timeout: float = 300):
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "aiayn", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


CLI_ARGS = ["train", "--task", "reverse", "--max-steps", "6", "--save-every", "3", "--eval-every", "1000",
            "--batch-size", "32", "--no-progress"]


def test_torchrun_cli_trains_saves_on_rank_0_and_resumes_under_another_world_size(tmp_path):
    import subprocess

    run_dir = tmp_path / "run"
    result = torchrun(*CLI_ARGS, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("finished 6 steps") == 1  # rank 0 reports, rank 1 is quiet
    assert [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")] == ["step-00000003", "step-00000006"]
    # A checkpoint saved by 2 processes resumes in 1: checkpoints hold full state dicts, and the
    # data position counts batches of the task's list, whatever the world size.
    single = subprocess.run([sys.executable, "-m", "aiayn", "train", "--resume", "--run-dir", str(run_dir),
                             "--max-steps", "8", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    assert "resuming" in single.stdout and "(step 6, epoch 0)" in single.stdout
    assert "finished 8 steps" in single.stdout


def test_torchrun_world_larger_than_the_epoch_is_one_clear_error(tmp_path):
    # 50,000 training sequences in batches of 40,000: 2 batches per epoch, 3 processes need 3.
    result = torchrun(*CLI_ARGS, "--batch-size", "40000", "--run-dir", str(tmp_path / "run"), nproc=3)
    assert result.returncode != 0
    assert result.stderr.count("Error: 3 processes x grad_accum 1 need 3 batches per step, but an epoch "
                               "has only 2 batches") == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split("Error: 3 processes")[0][-500:]


def test_torchrun_an_error_every_rank_raises_is_said_once_by_rank_0(tmp_path):
    # Resuming a run directory that does not exist fails on every rank alike; torchrun stops the
    # job once one rank exits, and the ranks > 0 wait before speaking: one line, rank 0's.
    missing = tmp_path / "no-such-run"
    result = torchrun("train", "--resume", "--run-dir", str(missing), "--no-progress", nproc=2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and errors[0].startswith("Error: ") and str(missing) in errors[0], result.stderr[-3000:]
    assert not missing.exists()


@pytest.mark.parametrize(("args", "needle"), [
    (["--fsdp"], "--fsdp shards over several processes; launch with torchrun"),
])
def test_single_process_bad_parallel_options_exit_2(tmp_path, args, needle, run_aiayn):
    code, _, err = run_aiayn(*CLI_ARGS, "--run-dir", str(tmp_path / "r"), *args)  # fails on a traceback
    assert code == 2 and needle in err
