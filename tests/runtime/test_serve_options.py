"""kiln serve's run-time flags: a true / false flag takes only a true or false word, and each
reaches the engine model's run-time options."""
import pytest

from kiln.cli import main

FLAGS = ["--enable-prefix-reuse", "--batch-invariant", "--kv-cache-reserve"]


@pytest.mark.parametrize("flag", FLAGS)
def test_a_true_false_flag_refuses_other_words(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "/nonexistent/repo", flag, "ture"])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected true or false, got 'ture'" in capsys.readouterr().err


class Refused(Exception):
    pass


@pytest.fixture
def serve_options(monkeypatch):
    """kiln serve with these arguments -> the run-time options it gives the server (TritonServer's
    constructor stands in: it records them and starts nothing)"""
    seen = {}

    def server(repo, *args):
        seen.update(args[-1])
        raise Refused

    monkeypatch.setattr("kiln.triton_repo.serve.TritonServer", server)

    def run(*arguments: str) -> dict:
        seen.clear()
        with pytest.raises(Refused):
            main(["serve", "/nonexistent/repo", *arguments])
        return dict(seen)

    return run


@pytest.mark.parametrize("word, value", [("true", True), ("False", False), ("yes", True), ("0", False)])
def test_the_flags_reach_the_run_time_options(word, value, serve_options):
    seen = serve_options(*[part for flag in FLAGS for part in (flag, word)])
    assert seen == {"enable_prefix_reuse": value, "batch_invariant": value, "kv_cache_reserve": value}


def test_stream_interval_reaches_the_run_time_options(serve_options):
    assert serve_options("--stream-interval", "4") == {"stream_interval": 4}


@pytest.mark.parametrize("flag", ["--stream-interval", "--prefill-per-decode-from"])
@pytest.mark.parametrize("word", ["0", "-2", "1.5", "four"])
def test_a_count_flag_refuses_what_is_not_a_positive_integer(flag, word, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "/nonexistent/repo", flag, word])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected an integer >= 1, got '{word}'" in capsys.readouterr().err
