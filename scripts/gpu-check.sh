#!/usr/bin/env bash
# The GPU check (CONTRIBUTING.md, docs/gpu.md): what to run on a machine with a CUDA GPU, in the repo
# root of a copy of the working tree (its own torch, no network). In order, each part under
# its own timeout so the whole stays inside one 600 s device call:
#   1. the card (nvidia-smi), torch and the optional packages, the date;
#   2. the parity and consistency tests on the GPU, and the device tests of training (resume on the
#      GPU and across devices), the loaders and the serve engine's CUDA graphs: AIAYN_TEST_DEVICES=cuda,
#      -m "not cpu_only and not slow" (--slow: the slow ones too), the repo on PYTHONPATH;
#   3. python -m benchmarks.gpu, rows (a), (b), (c), each in its own process.
# Everything is printed and written to $OUT/gpu-check.log ($OUT: the folder the device tool brings
# back; else $TMPDIR or /tmp). Missing pure-Python packages travel as wheels in .whl/ (CONTRIBUTING.md):
# they are installed from there, never from the network. Exit status: 0 when every part passed.
#
#   scripts/gpu-check.sh                 # on the GPU machine (device tool: timeout_s=600)
#   scripts/gpu-check.sh --rows c        # only benchmark row (c)
#   scripts/gpu-check.sh --cpu-smoke     # here, on a CPU: a few tests and the benchmark at tiny sizes
#
# Timeouts in seconds (environment): GPU_CHECK_TESTS_TIMEOUT (150) and GPU_CHECK_ROW_TIMEOUTS
# ("a=180 b=110 c=130"): at most 570 s with the header's few, inside one 600 s device call. Sized on
# an H100 (2026-11-27, torch 2.11): the parity and consistency tests took 88-92 s (the device tests
# outside those folders, added since, take about 25 s on 2 CPU cores), row (a) 140 s and row (b) 50 s at
# "--repeats 2 --warmup 1 --iters 2" (torch.compile's first calls are most of it), row (c) 110 s for
# batch 1 alone. A row prints its table when it ends (row (c) after each batch size), so a timeout
# loses that row only. GPU_CHECK_BENCH_ARGS (default "--repeats 2 --warmup 1 --iters 2") goes to
# every row; PYTHON picks the interpreter (default python3); GPU_CHECK_TESTS the test paths.
set -uo pipefail  # no -e: a failed part is reported and the next one still runs

cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
OUTDIR=${OUT:-${TMPDIR:-/tmp}}
LOG="$OUTDIR/gpu-check.log"
TESTS_TIMEOUT=${GPU_CHECK_TESTS_TIMEOUT:-150}
ROW_TIMEOUTS=${GPU_CHECK_ROW_TIMEOUTS:-a=180 b=110 c=130}
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---repeats 2 --warmup 1 --iters 2}
DEVICE=cuda
SMOKE=""
ROWS=abc
MARK="not cpu_only and not slow"
# Outside tests/parity and tests/consistency, the tests that take `device` (or need CUDA): training
# on the device and resumed across devices, the loaders of every verb, the serve engine's CUDA graphs.
OPTION=tests/integration/test_device_option.py
DEVICE_TESTS="tests/unit/test_train_on_device.py $OPTION::test_load_text_model_and_stream_text
    $OPTION::test_read_text_model_of_a_hf_directory $OPTION::test_load_translator
    $OPTION::test_load_sentence_encoder $OPTION::test_load_served_model_and_decoder_embeddings
    $OPTION::test_load_explorable_and_its_views tests/serve/test_compiled_engine.py::test_cuda_graphs_replay_the_buckets"
TESTS=${GPU_CHECK_TESTS:-tests/parity tests/consistency $DEVICE_TESTS}
PARTS=()  # "part: result" lines for the summary
FAILED=0

usage() {
    echo "usage: scripts/gpu-check.sh [--cpu-smoke] [--rows abc] [--slow]" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-smoke)
            DEVICE=cpu
            SMOKE=--smoke
            TESTS=${GPU_CHECK_TESTS:-tests/parity/test_losses_vs_torch.py}
            ;;
        --rows) [ $# -ge 2 ] || usage; ROWS=$2; shift ;;
        --slow) MARK="not cpu_only" ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) usage ;;
    esac
    shift
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRANSFORMERS_VERBOSITY=error TRANSFORMERS_NO_ADVISORY_WARNINGS=1

record() {  # record NAME RC: one summary line; rc 124/137 is a timeout
    local name=$1 rc=$2 what
    case "$rc" in
        0) what=passed ;;
        124|137) what="TIMED OUT" ;;
        *) what="FAILED (exit $rc)" ;;
    esac
    [ "$rc" = 0 ] || FAILED=1
    PARTS+=("$name: $what")
    echo "--> $name: $what"
}

wheels() {  # carried wheels (.whl/*.whl, from `pip download` here) into a private site folder
    local site=${TMPDIR:-/tmp}/aiayn-gpu-check-site
    if compgen -G ".whl/*.whl" >/dev/null; then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl; then
            export PYTHONPATH="$PYTHONPATH:$site"
            echo "installed the carried wheels from .whl/ (no network): $(ls .whl | tr '\n' ' ')"
        else
            echo "the carried wheels in .whl/ did not install; going on without them"
        fi
    fi
}

header() {
    echo "# aiayn GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "device $DEVICE; tests: $(echo $TESTS) (-m \"$MARK\"); benchmark rows: $ROWS ${SMOKE}; log: $LOG"
    echo
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
        nvidia-smi
    else
        echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
    fi
    echo
    wheels
    # torch, the card, and which optional packages are here: a missing one skips its tests and peers.
    "$PY" - <<'EOF'
import importlib
import importlib.metadata
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
for name, without in [("transformers", "the Hugging Face parity tests skip and the transformers peers of rows (a) and (c) are skipped"),
                      ("gguf", "the GGUF parity tests skip"), ("tokenizers", "the tokenizer-based tests skip"),
                      ("safetensors", "aiayn.interop cannot load or export"), ("sacrebleu", "row (d) cannot score")]:
    try:
        importlib.import_module(name)
    except ImportError:
        print(f"{name}: not installed -> {without}")
        continue
    try:
        print(f"{name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"{name} (version unknown)")
import aiayn
print(f"aiayn imports from {aiayn.__file__}")
EOF
    record "environment" $?
}

tests() {
    echo
    echo "## tests, AIAYN_TEST_DEVICES=$DEVICE (timeout ${TESTS_TIMEOUT} s)"
    # shellcheck disable=SC2086  # TESTS is a list of paths
    AIAYN_TEST_DEVICES=$DEVICE timeout -k 10 "$TESTS_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -rfEs \
        --durations=5 -m "$MARK" $TESTS
    record "tests ($DEVICE)" $?
}

row_timeout() {  # row_timeout ROW: its seconds from ROW_TIMEOUTS (60 if it names none)
    local pair
    for pair in $ROW_TIMEOUTS; do
        [ "${pair%%=*}" = "$1" ] && { echo "${pair#*=}"; return; }
    done
    echo 60
}

benchmark() {
    local row limit
    for row in $(echo "$ROWS" | grep -o .); do
        limit=$(row_timeout "$row")
        echo
        echo "## benchmark row ($row) (timeout ${limit} s)"
        # shellcheck disable=SC2086  # SMOKE and BENCH_ARGS are lists of options
        timeout -k 10 "$limit" "$PY" -m benchmarks.gpu --rows "$row" --device "$DEVICE" $SMOKE $BENCH_ARGS
        record "benchmark row ($row)" $?
    done
}

main() {
    local start=$SECONDS
    header
    tests
    benchmark
    echo
    echo "## summary ($((SECONDS - start)) s)"
    printf '%s\n' "${PARTS[@]}"
    return $FAILED
}

mkdir -p "$OUTDIR"
main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
