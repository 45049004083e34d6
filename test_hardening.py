"""Hardening: inputs that must fail cleanly (issue 18, section 2).

The promise of the command line: a mistake is one line on stderr and exit status
2, nothing the user has is lost, memory stays within a few hundred MB. The
library's promise: a bad argument is a ValueError naming the argument, the value
and what was expected. Each test guards one class of input (every standard
stream, every configuration field, every tensor kind, every option that names a
file), not only the case that was found.

Most checks run the program in this process: tf.command_line() with sys.argv and
the standard streams replaced by what Python makes at start (a text stream of the
given encoding, None for a closed one, a file opened for reading). A few need a
real process: one real ascii stdout and one real closed stdout (the proof that the
stand-ins behave as a real start does), --save /dev/stderr with stderr appended to
a log, a pipe whose reader has left, and the memory bounds (a process's peak
memory is its own only when it starts small). They all start together, when the
first is needed, and run while the in-process tests do.

    python -m pytest -q test_hardening.py
"""

import contextlib
import inspect
import io
import json
import os
import signal
import stat
import subprocess
import sys
import time
import warnings

import pytest
import torch

import transformer as tf

HARDENING_HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_FILES = os.path.join(os.sep, "proc")           # the kernel's file system, spelt as the program sees it


@pytest.fixture(scope="module", autouse=True)
def hardening_one_thread():
    """One thread: the tensors are tiny, and the real processes below need the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hard(tmp_path_factory):
    """Untrained tiny checkpoints of each kind on the toy task's seed-0 split, as
    --save writes them, and a small pinyin<TAB>hanzi file. -> dict of paths and vocabularies."""
    folder = tmp_path_factory.mktemp("hardening")
    train_pairs, _ = tf.split_data(tf.make_toy_data(seed=0), seed=0)
    readings = tf.syllable_readings(train_pairs)
    sv, tv = tf.build_vocabs(train_pairs)
    vocab = tf.build_gpt_vocab(train_pairs)
    torch.manual_seed(0)
    models = {"encdec": (tf.Transformer(len(sv), len(tv), d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=32),
                         sv, tv),
              "gpt": (tf.DecoderOnlyTransformer(len(vocab), 16, 1, 2, 32, max_len=40), vocab, vocab),
              "llama": (tf.Llama(len(vocab), 16, 1, 2, n_kv_heads=1, max_len=40), vocab, vocab)}
    if "deepseek" in tf.MODEL_CLASSES:  # Part III's model kind
        models["deepseek"] = (tf.DeepSeekV3(len(vocab), d_model=16, n_layers=2, n_heads=2, kv_lora_rank=8,
                                            qk_nope_dim=4, qk_rope_dim=4, v_head_dim=4, d_ff=32, expert_d_ff=8,
                                            n_experts=4, top_k=2, max_len=40), vocab, vocab)
    paths = {"folder": folder, "sv": sv, "tv": tv, "vocab": vocab, "readings": readings}
    for kind, (model, src_vocab, tgt_vocab) in models.items():
        paths[kind] = str(folder / f"{kind}.pt")
        tf.save_checkpoint(paths[kind], kind, model, src_vocab, tgt_vocab, readings)
    tsv = folder / "pairs.tsv"
    tsv.write_text("".join(f"{p}\t{h}\n" for p, h in tf.make_toy_data(n_sentences=30, seed=0)), encoding="utf-8")
    paths["tsv"] = str(tsv)
    return paths


def _run_main(argv, stdin=None):
    """tf.main(argv) in-process: -> (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = tf.main(argv)
            except SystemExit as e:
                status = e.code
    finally:
        sys.stdin = saved
    return status, out.getvalue(), err.getvalue()


def _one_error_line(err):
    """err must be exactly one line, a transformer.py error, no traceback; -> that line."""
    assert err.count("\n") == 1 and err.endswith("\n"), err[:500]
    assert err.startswith("transformer.py: error: ") and "Traceback" not in err, err[:500]
    return err[:-1]


def _command_line(argv, stdin=None, stdout="memory", stderr="memory", encoding="utf-8"):
    """python transformer.py argv, in this process: tf.command_line() with sys.argv and
    the standard streams as Python makes them at start. stdin: an open text stream,
    or None (closed); stdout and stderr: "memory" (returned), an open text stream, or
    None (closed); encoding: stdout's (PYTHONIOENCODING), errors "strict" as Python's
    own; stderr's errors "backslashreplace", as Python's. Then what Python does at
    exit: flush both, and an error there is status 120 and a line on stderr.
    -> (status, stdout bytes, stderr text)."""
    out = err = None
    if stdout == "memory":
        out = io.BytesIO()
        stdout = io.TextIOWrapper(out, encoding=encoding, errors="strict")
    if stderr == "memory":
        err = io.BytesIO()
        stderr = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace", line_buffering=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["transformer.py", *argv])
        for name, stream in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
            patch.setattr(sys, name, stream)
            patch.setattr(sys, f"__{name}__", stream)
        try:
            status = tf.command_line()
        except SystemExit as e:
            status = e.code
        for stream in (sys.stdout, sys.stderr, stdout, stderr):  # at exit: the program's streams, then Python's
            try:
                if stream is not None:
                    stream.flush()
            except Exception as e:  # noqa: BLE001 -- what Python would print, and its status
                status = 120
                if err is not None:
                    err.write(f"Exception ignored flushing: {e!r}\n".encode())
    return (status, None if out is None else out.getvalue(),
            None if err is None else err.getvalue().decode("utf-8", "replace"))


@contextlib.contextmanager
def _as_fd(fd, f):
    """The open file f as this process's file descriptor fd (0, 1 or 2) for a while,
    as `< file`, `> file` or `2>> file` makes it for a program."""
    saved = os.dup(fd)
    os.dup2(f.fileno(), fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


# ---------------------------------------------------------------------------
# The real processes: all started at once, each test waits for its own
# ---------------------------------------------------------------------------

# python -c MEASURED: imports torch and transformer, notes the peak memory, runs
# "--command-line ARGS..." (the program, as `python transformer.py ARGS` would) or
# "--call PREPARE CALL..." (PREPARE, then each CALL's outcome), and writes the MB the
# peak grew by, the outcomes and the seconds it took, to the file $HARDENING_REPORT.
MEASURED = r"""
import json, os, resource, sys, time
import torch
import transformer as tf

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

def report(outcomes):
    with open(os.environ["HARDENING_REPORT"], "w", encoding="utf-8") as f:
        json.dump({"grown": peak() - start, "outcomes": outcomes, "seconds": time.monotonic() - began}, f)

how, *args = sys.argv[1:]
if how == "--command-line":
    sys.argv = ["transformer.py", *args]
    start, began = peak(), time.monotonic()
    status = tf.command_line()
    report([status])
    sys.exit(status)
prepare, *calls = args
scope = {"tf": tf, "torch": torch}
exec(prepare, scope)
start, began, outcomes = peak(), time.monotonic(), []
for call in calls:
    try:
        eval(call, scope)
        outcomes.append("ok")
    except Exception as e:
        outcomes.append(f"{type(e).__name__}: {e}")
report(outcomes)
"""
# A child of this big process starts with this process's peak memory as its own
# (Linux keeps the peak across exec); a child of a small shell starts with its own.
# "; exit $?" keeps sh from replacing itself with the command.
OWN_MEMORY = ["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-c", MEASURED]
PROGRAM = [sys.executable, "transformer.py"]
STDOUT_CLOSED = ["/bin/sh", "-c", '"$@" >&-; exit $?', "sh", *PROGRAM]
BIGRAM_PAIRS = ("chars = [chr(0x4E00 + i) for i in range(3000)]\n"
                "pairs = [(f's{i % 50}'.replace('0', 'o').replace('1', 'i')"
                ".translate(str.maketrans('23456789', 'abcdefgh')), chars[i]) for i in range(3000)]")
LONG_LINES = [("tabs", "wo" + "\t" * 2 * 10 ** 6 + "我",
               "expected 'pinyin<TAB>hanzi', found 2000001 tab-separated fields"),
              ("syllables", "a " * 2 * 10 ** 6 + "\t我",
               f"2000000 syllables; a sentence may have at most {tf.MAX_SYLLABLES}")]


def _views_checkpoint(hard, path):
    """A checkpoint whose state is views of one 4 MB storage under made-up names,
    adding up to what d_ff 2,000,000 needs (the model: 2.2 GB)."""
    checkpoint = torch.load(hard["gpt"], weights_only=True)
    config = dict(checkpoint["config"], d_ff=2_000_000)
    needed = tf.decoder_only_param_formula(**config)
    storage, state, at, i = torch.zeros(2 ** 20), {}, 0, 0
    while at < needed:
        n = min(2 ** 20 - 1, needed - at)
        state[f"made.up.{i}"] = storage[1:1 + n] if i % 2 else storage[:n]     # distinct data_ptr()s
        at, i = at + n, i + 1
    state["pos_encoding.pe"] = checkpoint["state_dict"]["pos_encoding.pe"]
    torch.save(dict(checkpoint, config=config, state_dict=state), path)


def _start(folder, name, command, stdin=subprocess.DEVNULL, stdout=None, stderr=None, env=(), **facts):
    """Popen command in this file's folder, stdout and stderr to files unless given.
    -> a dict for _finish, with facts the test needs."""
    paths = {what: folder / f"{name}.{what}" for what in ("stdout", "stderr", "report")}
    env = dict(os.environ, OMP_NUM_THREADS="1", HARDENING_REPORT=str(paths["report"]), **dict(env))
    with contextlib.ExitStack() as files:
        if stdout is None:
            stdout = files.enter_context(open(paths["stdout"], "wb"))
        if stderr is None:
            stderr = files.enter_context(open(paths["stderr"], "wb"))
        proc = subprocess.Popen(command, cwd=HARDENING_HERE, env=env, stdin=stdin, stdout=stdout, stderr=stderr)
    return dict(proc=proc, **paths, **facts)


def _finish(started, timeout=180):
    """Wait for a process _start began. -> (status, stdout bytes, stderr text,
    MB its peak memory grew by or None, outcomes or None)."""
    status = started["proc"].wait(timeout=timeout)
    read = lambda path: path.read_bytes() if path.exists() else b""  # noqa: E731
    report = json.loads(read(started["report"]) or "null") or {}
    return (status, read(started["stdout"]), read(started["stderr"]).decode("utf-8", "replace"),
            report.get("grown"), report.get("outcomes"))


@pytest.fixture(scope="module")
def real(hard, tmp_path_factory):
    """Every check that needs a real process, started at once: -> dict of name to _start's dict."""
    folder = tmp_path_factory.mktemp("real")
    started = {}
    try:
        # data loss: python transformer.py ... --save /dev/stderr 2>>train.log
        log = folder / "train.log"
        log.write_bytes(b"yesterday's training log\n")
        with open(log, "ab") as appended:
            started["dev-stderr"] = _start(folder, "dev-stderr", PROGRAM + [
                "--model", "encdec", "--epochs", "1", "--save", "/dev/stderr"], stderr=appended, log=log)
        # the stand-ins' proof: PYTHONIOENCODING=ascii python transformer.py ..., and ... >&-
        started["ascii"] = _start(folder, "ascii", PROGRAM + ["--load", hard["encdec"], "--translate", "wo ai"],
                                  env={"PYTHONIOENCODING": "ascii"})
        started["stdout-closed"] = _start(folder, "stdout-closed", STDOUT_CLOSED + [
            "--load", hard["encdec"], "--translate", "wo ai"])
        # python transformer.py ... --save m.pt | head -1, the reader gone before the first line
        r, w = os.pipe()
        os.close(r)
        started["broken-pipe"] = _start(folder, "broken-pipe", PROGRAM + [
            "--data", hard["tsv"], "--size", "small", "--epochs", "1", "--model", "gpt",
            "--save", str(folder / "piped.pt")], stdout=w, saved=folder / "piped.pt")
        os.close(w)
        # memory
        started["widest-beam"] = _start(folder, "widest-beam", OWN_MEMORY + [
            "--command-line", "--load", hard["encdec"], "--beam", str(tf.MAX_BEAM)])
        with open("/dev/zero", "rb") as zero:
            started["dev-zero"] = _start(folder, "dev-zero", OWN_MEMORY + [
                "--command-line", "--load", hard["encdec"], "--translate", "-"], stdin=zero)
        views = folder / "views.pt"
        _views_checkpoint(hard, views)
        started["views"] = _start(folder, "views", OWN_MEMORY + [
            "--call", f"path = {str(views)!r}", "tf.load_checkpoint(path)"], path=views)
        started["bigram"] = _start(folder, "bigram", OWN_MEMORY + ["--call", BIGRAM_PAIRS, "tf.BigramHMM(pairs)"])
        blank = folder / "blank.tsv"
        blank.write_bytes(b"\n" * (16 * 2 ** 20) + "wo\t我\nni\t你\n".encode())
        started["blank"] = _start(folder, "blank", OWN_MEMORY + [
            "--call", f"path = {str(blank)!r}", "tf.read_pairs(path)"], path=blank)
        long_paths = []
        for what, line, _ in LONG_LINES:
            long_paths.append(folder / f"long-{what}.tsv")
            long_paths[-1].write_text("wo\t我\n" + line + "\n", encoding="utf-8")
        started["long-lines"] = _start(folder, "long-lines", OWN_MEMORY + [
            "--call", f"paths = {[str(p) for p in long_paths]!r}",
            *(f"tf.read_pairs(paths[{i}])" for i in range(len(long_paths)))], paths=long_paths)
        yield started
    finally:
        for one in started.values():
            if one["proc"].poll() is None:
                one["proc"].kill()
            one["proc"].wait()


@pytest.fixture(scope="module", autouse=True)
def real_processes_start_with_the_first_test(request):
    """`real` starts with the first test of this file, when a test selected waits for it."""
    if any(item.path == request.path and "real" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("real")


def _no_training(monkeypatch):
    """Any training from here on fails the test: a refusal must come before the work."""
    def refuse(*args, **kwargs):
        raise AssertionError("training started before the refusal")
    monkeypatch.setattr(tf, "train", refuse)


# ===========================================================================
# Data loss: a standard stream is not a file the user named
# ===========================================================================

@pytest.mark.parametrize("name, fd", [("/dev/stdout", 1), ("/dev/fd/1", 1), (f"{KERNEL_FILES}/self/fd/1", 1),
                                      ("/dev/stdin", 0), (f"{KERNEL_FILES}/self/fd/0", 0)])
def test_save_to_any_standard_stream_that_is_a_file_is_refused(tmp_path, name, fd):
    # --save /dev/stdout > out.txt, /dev/stdin < in.txt: each stream's file is kept byte for byte
    kept = tmp_path / "stream.txt"
    kept.write_bytes(b"the user's file\n")
    with open(kept, "r+b") as f, _as_fd(fd, f), open(fd, "r" if fd == 0 else "w", encoding="utf-8",
                                                       closefd=False) as stream:
        streams = {"stdout": stream} if fd == 1 else {"stdin": stream}
        status, out, err = _command_line(["--model", "encdec", "--epochs", "1", "--save", name], **streams)
    assert status == 2 and kept.read_bytes() == b"the user's file\n"
    which = "standard output" if fd == 1 else "standard input"
    assert _one_error_line(err).endswith(f": that is {which} (file descriptor {fd}), not a file to save to;"
                                         f" name the file itself")


def test_save_checkpoint_itself_refuses_a_standard_stream(tmp_path, hard):
    model, _ = _gpt_and_vocab()
    log = tmp_path / "log.txt"
    log.write_bytes(b"log\n")
    with open(log, "ab") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            with pytest.raises(ValueError, match=r"that is standard error \(file descriptor 2\)"):
                tf.save_checkpoint("/dev/stderr", "gpt", model, hard["vocab"], hard["vocab"])
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert log.read_bytes() == b"log\n"


# ===========================================================================
# Tracebacks: every standard stream, every encoding
# ===========================================================================

@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "cp1252", "gbk"])
def test_stdout_that_cannot_write_hanzi_is_refused_before_the_work(hard, encoding):
    # gbk writes hanzi but not the report's mark for a wrong answer: refused too, before, not at the report
    for argv in (["--load", hard["encdec"], "--translate", "wo ai"], ["--load", hard["gpt"]],
                 ["--model", "gpt", "--epochs", "1"]):
        start = time.perf_counter()
        status, out, err = _command_line(argv, encoding=encoding)
        assert status == 2 and out == b"", (argv, err)
        assert _one_error_line(err).startswith("transformer.py: error: standard output's encoding (")
        what = "'✗'" if encoding == "gbk" else "hanzi"
        assert f"cannot write {what}; set PYTHONIOENCODING=utf-8" in err
        assert time.perf_counter() - start < 5        # refused, not trained first


def test_file_names_that_are_not_utf8_are_shown_escaped_on_a_strict_utf8_stdout(hard, tmp_path):
    # --load $'\xff.pt' and --save $'\xfe.pt': argv holds them as \udcff; stdout shows \xff
    load = os.path.join(os.fsencode(hard["folder"]), b"\xff.pt")
    with open(hard["gpt"], "rb") as f, open(load, "wb") as g:
        g.write(f.read())
    status, out, err = _command_line(["--load", os.fsdecode(load), "--beam", "1"])
    assert status == 0 and err == "", err
    assert out.decode("utf-8").startswith("device: ") and b"loaded " in out and b"\\xff.pt;" in out
    save = os.path.join(os.fsencode(str(tmp_path)), b"\xfe.pt")
    status, out, err = _command_line(["--data", hard["tsv"], "--size", "small", "--epochs", "1", "--model", "gpt",
                                      "--save", os.fsdecode(save)])
    assert status == 0 and err == "", err
    assert out.decode("utf-8").rstrip().endswith("\\xfe.pt") and os.path.exists(save)
    # and every message about such a file: read_pairs, load_checkpoint
    missing = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"\xfd.tsv"))
    with pytest.raises(ValueError) as info:
        tf.read_pairs(missing)
    assert "\\xfd.tsv: No such file or directory" in str(info.value)
    str(info.value).encode("utf-8")                     # printable anywhere


def test_a_vocabulary_with_lone_surrogates_is_refused_at_load(hard, tmp_path):
    checkpoint = torch.load(hard["gpt"], weights_only=True)
    itos = checkpoint["tgt_vocab"]
    forged = itos[:4] + sorted(itos[4:-1] + ["\ud800"])       # still "sorted", as check_vocab wants
    forged = tf.Vocab(forged).itos
    path = tmp_path / "surrogate.pt"
    torch.save(dict(checkpoint, src_vocab=forged, tgt_vocab=forged), path)
    with pytest.raises(ValueError) as info:
        tf.load_checkpoint(str(path))
    assert "holds '\\ud800', which is not text" in str(info.value)
    status, out, err = _run_main(["--load", str(path), "--translate", "wo ai", "--device", "cpu"])
    assert status == 2 and out == "" and "\\ud800" in _one_error_line(err)


@pytest.mark.parametrize("beam", [str(tf.MAX_BEAM + 1), "1099511627776", str(2 ** 62)])
def test_cli_beam_beyond_its_cap_is_one_line_before_the_work(hard, beam):
    status, out, err = _run_main(["--load", hard["encdec"], "--translate", "wo ai", "--beam", beam])
    assert status == 2 and out == ""
    assert _one_error_line(err) == f"transformer.py: error: --beam {beam}: expected 1 to {tf.MAX_BEAM}"


# ===========================================================================
# Configuration: every field checked for type and range, before anything is computed
# ===========================================================================

def test_every_configuration_field_of_every_kind_has_a_rule():
    # a new keyword of a model class needs a line in CONFIG_FIELDS, or its checkpoints cannot load
    for kind, cls in tf.MODEL_CLASSES.items():
        fields = set(inspect.signature(cls).parameters)
        assert fields <= set(tf.CONFIG_FIELDS), (kind, fields - set(tf.CONFIG_FIELDS))


NAN, INF = float("nan"), float("inf")
FORGED_FIELDS = [  # (kind, field, value, words of the message)
    ("llama", "n_heads", 0, "n_heads must be an integer from 1 to 2,147,483,647, got 0"),
    ("llama", "d_model", 1e308, "d_model must be an integer from 1 to 2,147,483,647, got 1e+308"),
    ("llama", "d_model", 10 ** 400, "d_model must be an integer from 1"),
    ("llama", "d_ff", 2.5, "d_ff must be an integer from 1 to 2,147,483,647 or None, got 2.5"),
    ("llama", "n_kv_heads", -1, "n_kv_heads must be an integer from 1"),
    ("llama", "norm_eps", "x", "norm_eps must be a number from 1.17549e-38 to 1, got 'x'"),
    ("llama", "norm_eps", -1e-6, "norm_eps must be a number"),
    ("llama", "norm_eps", NAN, "norm_eps must be a number"),
    ("llama", "norm_eps", 0.0, "norm_eps must be a number"),
    ("llama", "rope_theta", 0.0, "rope_theta must be a number from 1 to 1e+30, got 0.0"),
    ("llama", "rope_theta", -10000.0, "rope_theta must be a number"),
    ("llama", "rope_theta", NAN, "rope_theta must be a number"),
    ("llama", "rope_theta", INF, "rope_theta must be a number"),
    ("llama", "tie_weights", 1, "tie_weights must be True or False, got 1"),
    ("llama", "qkv_bias", "yes", "qkv_bias must be True or False"),
    ("gpt", "dropout", NAN, "dropout must be a number from 0 to 1, got nan"),
    ("gpt", "dropout", 1.5, "dropout must be a number from 0 to 1"),
    ("gpt", "n_layers", 10 ** 6, "n_layers must be an integer from 1 to 1,024"),
    ("gpt", "n_layers", True, "n_layers must be an integer"),
    ("gpt", "max_len", 0, "max_len must be an integer"),
    ("encdec", "dropout", "x", "dropout must be a number"),
    ("encdec", "norm_first", "no", "norm_first must be True or False"),
    ("encdec", "share_embeddings", None, "share_embeddings must be True or False, got None"),
    ("encdec", "src_vocab_size", -3, "src_vocab_size must be an integer"),
    ("encdec", "pad_id", -1, "pad_id must be an integer from 0"),
    ("encdec", "surprise", 1, "config field 'surprise' is not one a encdec model takes"),
    ("gpt", "vocab_size", "missing", "config lacks vocab_size, which a gpt model needs"),
    ("deepseek", "rope_theta", NAN, "rope_theta must be a number"),
    ("deepseek", "norm_eps", -1.0, "norm_eps must be a number"),
    ("deepseek", "n_experts", 0.5, "n_experts must be an integer"),
    ("deepseek", "routed_scale", NAN, "routed_scale must be a number"),
    ("deepseek", "kv_lora_rank", 0, "kv_lora_rank must be an integer from 1"),
    ("deepseek", "q_lora_rank", "x", "q_lora_rank must be an integer from 1 to 2,147,483,647 or None"),
    ("deepseek", "rope_interleave", 0, "rope_interleave must be True or False"),
    ("llama", "n_experts", -1, "n_experts must be an integer from 0"),
    ("llama", "head_dim", 0, "head_dim must be an integer from 1"),
    ("llama", "window", 0, "window must be an integer from 1"),
    ("llama", "rope_scaling", "yarn", "rope_scaling must be a dict or None, got 'yarn'"),
]
FORGED_FIELDS = [case for case in FORGED_FIELDS if case[0] in tf.MODEL_CLASSES
                 and (case[2] == "missing" or case[1] in inspect.signature(tf.MODEL_CLASSES[case[0]]).parameters
                      or case[1] == "surprise")]


@pytest.mark.parametrize("kind, field, value, words", FORGED_FIELDS,
                         ids=[f"{k}-{f}-{v!r}"[:40] for k, f, v, _ in FORGED_FIELDS])
def test_load_checkpoint_refuses_each_forged_field_before_computing_from_it(hard, tmp_path, monkeypatch,
                                                                            kind, field, value, words):
    checkpoint = torch.load(hard[kind], weights_only=True)
    config = dict(checkpoint["config"])
    if value == "missing":
        del config[field]
    else:
        config[field] = value
    path = tmp_path / "forged.pt"
    torch.save(dict(checkpoint, config=config), path)
    # nothing is computed from the configuration before it is checked: no formula, no model
    for name in list(tf.PARAMETER_FORMULAS):
        monkeypatch.setitem(tf.PARAMETER_FORMULAS, name, lambda **kw: pytest.fail("formula before the check"))
    with pytest.raises(ValueError) as info:
        tf.load_checkpoint(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: damaged checkpoint (ValueError: ") and words in message, message
    assert "\n" not in message


@pytest.mark.parametrize("build, words", [
    (lambda: tf.Llama(50, 16, 1, 2, rope_theta=0.0), "rope_theta must be a number from 1 to 1e+30, got 0.0"),
    (lambda: tf.Llama(50, 16, 1, 2, rope_theta=-1.0), "rope_theta must be a number"),
    (lambda: tf.Llama(50, 16, 1, 2, rope_theta=NAN), "rope_theta must be a number"),
    (lambda: tf.Llama(50, 16, 1, 2, norm_eps=NAN), "norm_eps must be a number"),
    (lambda: tf.Llama(50, 16, 1, 2, norm_eps=-1e-6), "norm_eps must be a number"),
    (lambda: tf.Llama(50, 16, 1, 2, norm_eps="x"), "norm_eps must be a number"),
    (lambda: tf.Transformer(10, 10, d_model=16, n_heads=2, d_ff=32, n_layers=1, dropout="x"),
     "dropout must be a number from 0 to 1, got 'x'"),
    (lambda: tf.Transformer(10, 10, d_model=16, n_heads=2, d_ff=32, n_layers=1, norm_first="yes"),
     "norm_first must be True or False"),
    (lambda: tf.DecoderOnlyTransformer(10, 16, 1, 2, 32, dropout=NAN), "dropout must be a number"),
    (lambda: tf.DecoderOnlyTransformer(10, 16, 1, 2, 32, tie_weights="no"), "tie_weights must be True or False"),
    (lambda: tf.DeepSeekV3(50, 16, 1, 2, 8, 4, 4, 4, 32, 8, 4, 2, rope_theta=NAN), "rope_theta must be a number"),
    (lambda: tf.DeepSeekV3(50, 16, 1, 2, 8, 4, 4, 4, 32, 8, 4, 2, norm_eps=0.0), "norm_eps must be a number"),
], ids=["theta-0", "theta-negative", "theta-nan", "eps-nan", "eps-negative", "eps-str", "encdec-dropout-str",
        "encdec-norm-first-str", "gpt-dropout-nan", "gpt-tie-str", "deepseek-theta-nan", "deepseek-eps-0"])
def test_models_refuse_numbers_that_would_compute_nan_naming_the_field(build, words):
    with pytest.raises(ValueError) as info:
        build()
    assert words in str(info.value), str(info.value)


def test_the_smallest_accepted_eps_and_theta_compute_no_nan():
    # the table's bounds are the edge of what computes: at them, even a zero input stays finite
    model = tf.Llama(50, 16, 1, 2, rope_theta=1.0, norm_eps=torch.finfo(torch.float32).tiny)
    with torch.no_grad():
        model.token_embedding.weight[7].zero_()                             # a zero vector through RMSNorm
        logits = model(torch.tensor([[7, 7, 3]]))                           # [1, 3, 50]
    assert torch.isfinite(logits).all()


# ===========================================================================
# Memory: nothing is built or read beyond what the file holds
# ===========================================================================

def test_right_names_with_a_wrong_shape_are_refused_before_building(hard, tmp_path):
    # the count of values matches, the names match, one shape is transposed: the meta model says so
    checkpoint = torch.load(hard["gpt"], weights_only=True)
    state = dict(checkpoint["state_dict"])
    state["layers.0.ffn.fc1.weight"] = state["layers.0.ffn.fc1.weight"].t().contiguous()  # [16, 32], not [32, 16]
    path = tmp_path / "transposed.pt"
    torch.save(dict(checkpoint, state_dict=state), path)
    with pytest.raises(ValueError) as info:
        tf.load_checkpoint(str(path))
    assert ("weight 'layers.0.ffn.fc1.weight': the configuration implies [32, 16], the file holds [16, 32]"
            in str(info.value))


def test_translate_stdin_lines_are_bounded(hard):
    # a line past MAX_LINE characters ends the answers with one line; the lines before it answer
    status, out, err = _run_main(["--load", hard["encdec"], "--translate", "-", "--device", "cpu"],
                             stdin="wo ai\n" + "wo " * (tf.MAX_LINE // 3 + 1) + "\nni hao\n")
    assert status == 2 and out.count("\n") == 1
    assert _one_error_line(err) == (f"transformer.py: error: --translate -: standard input, line 2: longer than"
                                    f" {tf.MAX_LINE:,} characters; stopped reading")


def test_translate_stdin_that_is_not_utf8_is_one_line(hard, tmp_path):
    (tmp_path / "in.txt").write_bytes(b"wo ai\n\xff\xfe\n")
    # < in.txt, stdin strict UTF-8 as Python makes it in most UTF-8 locales (in C.UTF-8 it is
    # surrogateescape: the bytes reach the program, which names them as an unknown syllable)
    with open(tmp_path / "in.txt", encoding="utf-8") as stdin:
        status, out, err = _command_line(["--load", hard["encdec"], "--translate", "-"], stdin=stdin)
    assert status == 2 and out.decode().count("\n") <= 1   # the decoder reads ahead: line 1 may not answer
    assert _one_error_line(err) == ("transformer.py: error: --translate -: standard input is not utf-8 text"
                                    " (invalid start byte); stopped reading")


def test_data_with_more_sentences_than_max_pairs_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tf, "MAX_PAIRS", 3)
    path = tmp_path / "many.tsv"
    path.write_text("wo\t我\nni\t你\nta\t他\nwo ai\t我爱\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r":4: more than 3 sentences; split the file"):
        tf.read_pairs(str(path))


def test_many_distinct_characters_leave_the_bigram_baseline_out(monkeypatch, capsys):
    # the baseline's tables are (C + 1) x C: past MAX_BASELINE_CHARACTERS it is not built at all
    monkeypatch.setattr(tf, "MAX_BASELINE_CHARACTERS", 3)
    monkeypatch.setattr(tf, "BigramHMM", lambda *a: pytest.fail("the baseline was built"))
    pairs = [("wo ai", "我爱"), ("ni hao", "你好")]
    args = type("Args", (), dict(free=False, beam=1, size="small"))
    tf.compare_with_baseline({}, pairs, pairs, args)
    out = capsys.readouterr().out
    assert "bigram HMM baseline  left out: 4 distinct characters, its tables grow with their square" \
           " (at most 3)" in out


def test_a_wide_beam_runs_in_bounded_batches(hard, monkeypatch):
    # beam k: k rows a sentence, so a batch holds batch_size // k sentences, B * k <= batch_size rows
    rows = []
    real = tf.beam_search

    def spy(step, start, n_steps, beam_size, *args, **kwargs):
        rows.append(start.size(0) * beam_size)
        return real(step, start, n_steps, beam_size, *args, **kwargs)
    monkeypatch.setattr(tf, "beam_search", spy)
    kind, model, sv, tv, readings = tf.load_checkpoint(hard["encdec"])
    sentences = ["wo ai xue xi"] * 20
    answers = tf.translate(model, sentences, sv, tv, readings, beam_size=16, batch_size=64)
    assert rows == [64] * 5 and len(answers) == 20
    assert len(set(answers)) == 1                                        # the same sentence, the same answer


def test_rows_per_batch_bounds_the_logits():
    assert tf.rows_per_batch(256, 13, 200) == 256                         # the toy task: unchanged
    assert tf.rows_per_batch(256, 202, 13000) == 2 ** 24 // (202 * 13000)  # 6 sentences, not 256
    assert tf.rows_per_batch(256, 10 ** 6, 10 ** 6) == 1                 # always at least one


# ===========================================================================
# Wrong answers, silently
# ===========================================================================

@pytest.mark.parametrize("option", ["--data", "--load", "--save"])
def test_an_empty_file_name_is_refused_not_ignored(option, monkeypatch):
    _no_training(monkeypatch)
    status, out, err = _run_main([option, "", "--device", "cpu"])
    assert status == 2 and out == ""
    assert _one_error_line(err) == f"transformer.py: error: {option}: expected a file name, got an empty one"
    status, _, err = _run_main([f"{option}=", "--device", "cpu"])
    assert status == 2 and "expected a file name, got an empty one" in err


def test_save_checkpoint_refuses_a_kind_it_could_not_load(tmp_path, hard):
    model, vocab = _gpt_and_vocab()
    for kind in ("bogus", "llama", "encdec"):                   # unknown, or not this model's class
        with pytest.raises(ValueError) as info:
            tf.save_checkpoint(str(tmp_path / "m.pt"), kind, model, vocab, vocab)
        assert f"kind {kind!r} with a DecoderOnlyTransformer: expected one of 'encdec' with a Transformer" \
               in str(info.value)
    assert not (tmp_path / "m.pt").exists()


def _gpt_and_vocab():
    vocab = tf.Vocab(["wo", "ai", "我", "爱", tf.SEP])
    torch.manual_seed(0)
    return tf.DecoderOnlyTransformer(len(vocab), 16, 1, 2, 32, max_len=8), vocab


# ===========================================================================
# Late refusals and unclear messages
# ===========================================================================

@pytest.mark.parametrize("target, words", [
    (f"{KERNEL_FILES}/x.pt", f"inside {KERNEL_FILES} or /sys, the kernel's files; expected a file on a disk"),
    ("/sys/x.pt", f"inside {KERNEL_FILES} or /sys, the kernel's files; expected a file on a disk"),
    ("LONG", "a name of 303 bytes; this folder takes 255"),
], ids=["proc", "sys", "300-character-name"])
def test_an_unwritable_save_target_is_refused_before_training(tmp_path, monkeypatch, target, words):
    _no_training(monkeypatch)
    target = str(tmp_path / ("a" * 300 + ".pt")) if target == "LONG" else target
    status, out, err = _run_main(["--save", target, "--device", "cpu", "--epochs", "1"])
    assert status == 2 and out == ""
    line = _one_error_line(err)
    assert line.startswith(f"transformer.py: error: --save {tf.quote(target)}: ") and line.endswith(words), line
    assert len(line) < 200                               # the path is cut, not repeated


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_save_folder_is_refused_before_training(tmp_path, monkeypatch):
    _no_training(monkeypatch)
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        status, _, err = _run_main(["--save", str(folder / "m.pt"), "--device", "cpu"])
    finally:
        folder.chmod(0o755)
    assert status == 2 and _one_error_line(err).endswith("cannot write in its folder (Permission denied)")


def test_save_folder_probe_leaves_nothing_behind(tmp_path, hard):
    assert tf.check_save_target(str(tmp_path / "m.pt"), None) is None
    assert list(tmp_path.iterdir()) == []


def _library_calls(hard):
    kind, model, sv, tv, readings = tf.load_checkpoint(hard["encdec"])
    gkind, gpt, _, vocab, _ = tf.load_checkpoint(hard["gpt"])
    src = torch.tensor([sv.encode(["wo", "ai"])])                                # [1, 2]
    step = lambda ids, cache: torch.zeros(ids.size(0), len(tv))  # noqa: E731
    start = torch.full((1, 1), tf.Vocab.BOS)                                     # [1, 1]
    return {
        "translate-beam-0": (lambda: tf.translate(model, ["wo ai"], sv, tv, beam_size=0),
                             "beam_size must be an integer >= 1, got 0"),
        "translate-beam-minus-1": (lambda: tf.translate(model, ["wo ai"], sv, tv, beam_size=-1),
                                   "beam_size must be an integer >= 1, got -1"),
        "gpt-translate-beam-0": (lambda: tf.gpt_translate(gpt, ["wo ai"], vocab, beam_size=0),
                                 "beam_size must be an integer >= 1, got 0"),
        "beam-search-beam-minus-1": (lambda: tf.beam_search(step, start, 3, -1),
                                     "beam_size must be an integer >= 1, got -1"),
        "beam-search-beam-float": (lambda: tf.beam_search(step, start, 3, 2.0),
                                   "beam_size must be an integer >= 1, got 2.0"),
        "greedy-max-len-2.5": (lambda: tf.greedy_decode(model, src, tf.Vocab.BOS, tf.Vocab.EOS, 2.5),
                               "max_len must be 1 to 31 (the model's max_len less bos), an integer, got 2.5"),
        "translate-batch-0": (lambda: tf.translate(model, ["wo ai"], sv, tv, batch_size=0),
                              "batch_size must be an integer >= 1, got 0"),
        "translate-batch-minus-1": (lambda: tf.translate(model, ["wo ai"], sv, tv, batch_size=-1),
                                    "batch_size must be an integer >= 1, got -1"),
        "generate-generator-5": (lambda: gpt.generate(torch.tensor([[4, 5]]), 2, temperature=1.0, generator=5),
                                 "generator must be a torch.Generator or None, got int"),
        "read-pairs-none": (lambda: tf.read_pairs(None), "path must be a file name (str or os.PathLike), got NoneType"),
        "bigram-hmm-empty": (lambda: tf.BigramHMM([]), "pairs must be a non-empty list of (pinyin, hanzi)"),
        "evaluate-empty": (lambda: tf.evaluate(lambda s: s, []), "pairs is empty: there is nothing to evaluate on"),
        "load-bad-device": (lambda: tf.load_checkpoint(hard["encdec"], "xyz"),
                            "device 'xyz' is not a device name (cpu, cuda, mps, ...)"),
    }


LIBRARY_CALLS = ["translate-beam-0", "translate-beam-minus-1", "gpt-translate-beam-0", "beam-search-beam-minus-1",
                 "beam-search-beam-float", "greedy-max-len-2.5", "translate-batch-0", "translate-batch-minus-1",
                 "generate-generator-5", "read-pairs-none", "bigram-hmm-empty", "evaluate-empty", "load-bad-device"]


@pytest.mark.parametrize("name", LIBRARY_CALLS)
def test_library_refusals_are_value_errors_naming_the_argument(hard, name):
    call, words = _library_calls(hard)[name]
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value).startswith(words) or words in str(info.value), str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available() is False, reason="CUDA is here")
def test_load_on_an_absent_device_blames_the_device_not_the_file(hard):
    with pytest.raises(ValueError, match=r"^device 'cuda' is not available here$"):
        tf.load_checkpoint(hard["encdec"], "cuda")


@pytest.mark.parametrize("what", ["sparse", "sparse-csr", "quantized", "complex32", "complex64", "int64",
                                  "float8"])
def test_checkpoints_of_other_tensor_kinds_are_refused_in_one_line_without_warnings(hard, tmp_path, what):
    checkpoint = torch.load(hard["gpt"], weights_only=True)
    state = dict(checkpoint["state_dict"])
    w = state["layers.0.ffn.fc1.weight"]                                  # [32, 16]
    forge = {
        "sparse": lambda: w.to_sparse(), "sparse-csr": lambda: w.to_sparse_csr(),
        "quantized": lambda: torch.quantize_per_tensor(w, 0.1, 0, torch.qint8),
        "complex32": lambda: w.to(torch.complex32), "complex64": lambda: w.to(torch.complex64),
        "int64": lambda: w.long(), "float8": lambda: w.to(torch.float8_e4m3fn)}[what]
    path = tmp_path / f"{what}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                                   # torch's own notes while forging
        state["layers.0.ffn.fc1.weight"] = forge()
        torch.save(dict(checkpoint, state_dict=state), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                    # a warning would be a second line
        with pytest.raises(ValueError) as info:
            tf.load_checkpoint(str(path))
    assert "'layers.0.ffn.fc1.weight' is a " in str(info.value) and "expected dense float32" in str(info.value)
    status, out, err = _command_line(["--load", str(path), "--translate", "wo ai"])
    assert status == 2 and out == b"" and "expected dense float32" in _one_error_line(err)


def test_write_only_stdin_is_named_before_the_work(hard, tmp_path):
    # python transformer.py --translate - 0>file: Python makes its stdin a reader of fd 0 all the same
    with open(tmp_path / "file", "wb") as f, open(f.fileno(), "r", encoding="utf-8", closefd=False) as stdin:
        status, out, err = _command_line(["--model", "encdec", "--epochs", "1", "--translate", "-"], stdin=stdin)
    assert status == 2 and out == b""
    assert _one_error_line(err) == ("transformer.py: error: --translate -: cannot read standard input"
                                    " (Bad file descriptor)")


# ===========================================================================
# Minor
# ===========================================================================

@pytest.mark.skipif(os.geteuid() != 0, reason="only root can save over another user's file")
def test_root_saving_over_a_users_file_keeps_its_owner_and_mode(tmp_path, hard):
    target = tmp_path / "theirs.pt"
    target.write_bytes(b"old")
    os.chown(target, 1234, 5678)
    target.chmod(0o640)
    model, vocab = _gpt_and_vocab()
    tf.save_checkpoint(str(target), "gpt", model, vocab, vocab)
    st = os.stat(target)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 5678, 0o640)
    assert tf.load_checkpoint(str(target))[0] == "gpt"


def test_one_long_readings_string_under_many_keys_is_refused_at_once(hard, tmp_path):
    # a 4 MB string, pickled once, under 100 keys: read character by character, 400 million checks
    checkpoint = torch.load(hard["gpt"], weights_only=True)
    characters = "".join(t for t in checkpoint["tgt_vocab"] if len(t) == 1 and not t.isascii())
    long = (characters * (4 * 2 ** 20 // len(characters) + 1))[:4 * 2 ** 20]
    path = tmp_path / "readings.pt"
    torch.save(dict(checkpoint, readings={f"s{i}": long for i in range(100)}), path)
    assert os.path.getsize(path) < 16 * 2 ** 20
    start = time.perf_counter()
    with pytest.raises(ValueError, match="readings must map syllables to characters of the vocabulary"):
        tf.load_checkpoint(str(path))
    assert time.perf_counter() - start < 1.5
    # what save_checkpoint writes, every character once, still loads
    everything = {f"s{i}": characters for i in range(100)}
    torch.save(dict(checkpoint, readings=everything), path)
    assert tf.load_checkpoint(str(path))[4]["s7"] == set(characters)


@pytest.mark.parametrize("option", ["--data", "--load"])
def test_a_fifo_with_no_writer_is_refused_not_waited_on(tmp_path, option, monkeypatch):
    _no_training(monkeypatch)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    previous = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("waited on the FIFO"))
    signal.alarm(10)
    try:
        status, out, err = _run_main([option, str(fifo), "--device", "cpu"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert status == 2 and out == ""
    words = "found 0 pinyin<TAB>hanzi lines" if option == "--data" else "not a readable checkpoint"
    assert words in _one_error_line(err)


@pytest.mark.parametrize("hanzi, name", [("我\u0301", "combining acute"), ("我\ufe0f", "variation selector"),
                                         ("我\U000e0100", "supplementary variation selector"),
                                         ("我\u200d", "zero-width joiner")])
def test_read_pairs_refuses_marks_and_invisible_characters_as_hanzi(tmp_path, hanzi, name):
    path = tmp_path / "marks.tsv"
    path.write_text(f"ni hao\t你好\nwo ai\t{hanzi}\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        tf.read_pairs(str(path))
    assert str(info.value).startswith(f"{path}:2: hanzi "), name
    assert "holds an ASCII, space or control character or a combining mark" in str(info.value)


# ===========================================================================
# In a real process of their own (see `real`): started together with the
# first test of the file, so they come last, and are waited for here
# ===========================================================================

def test_save_to_dev_stderr_appended_to_a_log_is_refused_and_the_log_kept(real):
    # python transformer.py --model encdec --epochs 1 --save /dev/stderr 2>>train.log: a real process
    status, out, _, _, _ = _finish(real["dev-stderr"])
    text = real["dev-stderr"]["log"].read_bytes()
    assert status == 2 and out == b""
    assert text.startswith(b"yesterday's training log\n")
    line = _one_error_line(text[len(b"yesterday's training log\n"):].decode())
    assert line == ("transformer.py: error: --save '/dev/stderr': that is standard error (file descriptor 2),"
                    " not a file to save to; name the file itself")


def test_a_real_python_with_an_ascii_stdout_is_refused_in_one_line(hard, real):
    # the in-process stand-ins above stand for this: PYTHONIOENCODING=ascii python transformer.py ...
    status, out, err, _, _ = _finish(real["ascii"])
    assert status == 2 and out == b""
    assert _one_error_line(err) == ("transformer.py: error: standard output's encoding (ascii) cannot write hanzi;"
                                    " set PYTHONIOENCODING=utf-8 or use a UTF-8 locale")
    # and the stand-in says the same, byte for byte
    assert _command_line(["--load", hard["encdec"], "--translate", "wo ai"], encoding="ascii") == (2, b"", err)


def test_closed_stdout_refuses_answers_and_saves_without_a_traceback(hard, tmp_path, real):
    # python transformer.py --load m.pt --translate "wo ai" >&-: a real process, and its stand-in here
    status, _, err, _, _ = _finish(real["stdout-closed"])
    assert status == 2
    assert _one_error_line(err) == ("transformer.py: error: --translate: standard output is closed;"
                                    " the answers would be lost")
    assert _command_line(["--load", hard["encdec"], "--translate", "wo ai"], stdout=None) == (2, None, err)
    # python transformer.py --data pairs.tsv ... --save m.pt >&-: the work is done, nothing to say
    target = tmp_path / "saved.pt"
    status, _, err = _command_line(["--data", hard["tsv"], "--size", "small", "--epochs", "1", "--model", "encdec",
                                    "--save", str(target)], stdout=None)
    assert (status, err) == (0, "")
    assert tf.load_checkpoint(str(target))[0] == "encdec"
    # and with stderr closed as well, a refusal still exits 2
    status, _, _ = _command_line(["--beam", "0"], stdout=None, stderr=None)
    assert status == 2


def test_translate_stdin_from_dev_zero_stops_at_once_in_bounded_memory(real):
    # python transformer.py --load m.pt --translate - < /dev/zero, in a process of its own for the memory
    status, out, err, grown, _ = _finish(real["dev-zero"])
    seconds = json.loads(real["dev-zero"]["report"].read_text())["seconds"]
    assert status == 2 and out == b"" and seconds < 10
    assert _one_error_line(err).endswith(f"line 1: longer than {tf.MAX_LINE:,} characters; stopped reading")
    assert grown < 150, f"{grown} MB"


def test_views_of_one_storage_under_made_up_names_are_refused_before_building(real):
    # a 4 MB storage, cut into views that add up to what d_ff 2,000,000 needs (the model: 2.2 GB)
    path = real["views"]["path"]                                         # _views_checkpoint made it
    assert os.path.getsize(path) < 8 * 2 ** 20
    status, _, err, grown, outcomes = _finish(real["views"])
    assert status == 0 and outcomes, err
    outcome = outcomes[0]
    assert outcome.startswith(f"ValueError: {path}: damaged checkpoint") and "view into the storage" in outcome
    assert grown < 100, f"{grown} MB"


def test_bigram_hmm_memory_stays_near_one_table(real):
    # 3,000 characters (BIGRAM_PAIRS): one (C + 1) x C float table is 36 MB; out-of-place steps held three or four
    status, _, err, grown, outcomes = _finish(real["bigram"])
    assert status == 0 and outcomes == ["ok"] and grown < 90, (err, outcomes, grown)


def test_data_line_of_millions_of_tabs_or_syllables_is_refused_without_listing_them(real):
    # split, either would be a list of two million strings: over 100 MB for a 4 MB line. Both are read
    # in one process, one after the other: its peak bounds each one's
    status, _, err, grown, outcomes = _finish(real["long-lines"])
    assert status == 0 and outcomes, err
    for (_, _, words), path, outcome in zip(LONG_LINES, real["long-lines"]["paths"], outcomes, strict=True):
        assert outcome == f"ValueError: {path}:2: {words}", outcome
    assert grown < 50, f"{grown} MB"


def test_data_file_of_blank_lines_reads_in_memory_proportional_to_the_file(real):
    # 16 MB of blank lines: listed, they cost ~0.5 GB; visited one by one, a small multiple of the file
    path = real["blank"]["path"]
    status, _, err, grown, outcomes = _finish(real["blank"])
    assert status == 0 and outcomes == ["ok"], (err, outcomes)
    assert grown < 100, f"{grown} MB"
    assert tf.read_pairs(str(path)) == [("ni", "你"), ("wo", "我")]


def test_cli_widest_beam_stays_within_a_few_hundred_mb(real):
    # the report answers 240 held-out sentences: with every one in a batch, beam 64 took 163 MB
    # here and beam 100 1.3 GB; in batches of 256 rows it takes about 30 MB
    status, out, err, grown, _ = _finish(real["widest-beam"])
    assert status == 0 and err == "", err
    assert grown < 100, f"{grown} MB"


def test_broken_pipe_mid_training_still_saves_the_model(hard, real):
    # python transformer.py ... --save m.pt | head -1: the reader leaves, the model is still saved
    # (a real process: what Python does at exit with a broken stdout is part of the promise)
    target = real["broken-pipe"]["saved"]
    status, _, err, _, _ = _finish(real["broken-pipe"])
    assert status == 0, err
    assert err == ("transformer.py: note: the reader of standard output left early (broken pipe); the rest of"
                   " the output was dropped, the work was done\n")
    assert tf.load_checkpoint(str(target))[0] == "gpt"
    # without --save there is nothing to finish for: it stops at once, status 1, as before
    r, w = os.pipe()
    os.close(r)                                         # the reader has gone before the first line
    with open(w, "w", encoding="utf-8") as stdout:
        status, _, err = _command_line(["--data", hard["tsv"], "--size", "small", "--epochs", "1"], stdout=stdout)
    assert (status, err) == (1, "")
