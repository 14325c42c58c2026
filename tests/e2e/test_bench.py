"""kiln bench end to end at tiny scale: in process and against a real tritonserver."""
import json

import pytest

from kiln.bench import main, percentile
from kiln.triton_repo.serve import TritonServer

FIELDS = {"mode", "requests", "failed", "errors", "error_counts", "output_tokens", "duration_s", "output_tokens_per_s",
          "requests_per_s", "ttft_ms", "itl_ms", "e2e_ms", "kv_cache"}
DISTRIBUTION = {"p50", "p90", "p99", "mean"}


def test_percentiles_on_known_inputs():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)  # numpy.percentile gives 9.1
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def check_report(path, levels, key, requests, output_tokens, in_process, kv_reported=None):
    report = json.loads(path.read_text())
    assert report["output_tokens"] == output_tokens and report["machine"]["cpus"] >= 1
    assert [r[key] for r in report["results"]] == levels
    for result in report["results"]:
        assert FIELDS <= set(result) and result["failed"] == 0 and result["requests"] == requests
        assert result["output_tokens"] == requests * output_tokens  # no early stop
        for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert set(result[metric]) == DISTRIBUTION
            assert 0 < result[metric]["p50"] <= result[metric]["p99"]
        assert result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]
        if key == "concurrency":  # the steady state: the requests after the first wave of `concurrency`
            steady = result["steady"]
            assert steady["requests"] == requests - min(requests, result["concurrency"])
            if steady["requests"]:
                assert 0 < steady["itl_ms"]["p50"] <= steady["itl_ms"]["p99"] and steady["ttft_ms"]["p50"] > 0
        assert (result["kv_cache"] is not None) == (in_process if kv_reported is None else kv_reported)
        if in_process:
            assert 0 < result["kv_cache"]["utilization_max"] <= 1
    return report


def test_bench_in_process_sweeps_concurrency_and_plots(tiny_engines, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["--engine", str(tiny_engines("llama")), "--concurrency", "1", "3", "--requests", "4",
                 "--input-tokens", "12", "--output-tokens", "6", "--json", str(out), "--plot-dir", str(tmp_path)])
    assert code == 0
    check_report(out, [1, 3], "concurrency", 4, 6, in_process=True)
    for name in ("throughput.png", "latency.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_in_process_takes_run_time_options_and_refuses_bad_ones(tiny_engines, tmp_path, capsys):
    engine = str(tiny_engines("llama"))
    out = tmp_path / "bench.json"
    code = main(["--engine", engine, "--concurrency", "2", "--requests", "5", "--input-tokens", "12",
                 "--output-tokens", "4", "--runtime", "prefill_per_decode=1.5", "max_prefill_share=0.5",
                 "--json", str(out)])
    assert code == 0
    report = check_report(out, [2], "concurrency", 5, 4, in_process=True)
    assert report["runtime"] == {"prefill_per_decode": 1.5, "max_prefill_share": 0.5}
    for bad, said in ((["prefill_per_decode"], "takes KEY=VALUE"), (["no_such_option=1"], "unknown runtime options"),
                      (["prefill_per_decode=-2"], "prefill_per_decode must be"),
                      (["kv_cache_memory=4GiB"], "not a JSON value")):
        with pytest.raises(SystemExit):
            main(["--engine", engine, "--concurrency", "1", "--requests", "1", "--runtime", *bad])
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--url", "127.0.0.1:1", "--tokenizer", engine, "--runtime", "max_prefill_share=0.5"])
    assert "give a server its options when it starts" in capsys.readouterr().err


def test_bench_request_rate_with_a_prompt_file(tiny_engines, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"text": t}) for t in ["Hello there", "The import statement", "x"]))
    out = tmp_path / "rate.json"
    code = main(["--engine", str(tiny_engines("llama")), "--request-rate", "20", "--requests", "5",
                 "--prompts", str(prompts), "--output-tokens", "4", "--json", str(out)])
    assert code == 0
    check_report(out, [20.0], "request_rate", 5, 4, in_process=True)


def test_each_level_gets_its_own_prompts_so_none_hits_the_prefix_cache_of_the_one_before(tiny_engines, tmp_path):
    """Rates 20 and 20.5 (one integer part) once drew the same passages: the second level's
    prompts then found the first's KV blocks cached, and its TTFT read low."""
    out = tmp_path / "rates.json"
    code = main(["--engine", str(tiny_engines("llama")), "--request-rate", "20", "20.5", "--requests", "3",
                 "--input-tokens", "40", "--output-tokens", "2", "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert [r["kv_cache"]["prefix_hit_rate"] for r in results] == [0.0, 0.0]


@pytest.mark.slow
def test_bench_against_tritonserver(tiny_engines, tmp_path):
    engine = tiny_engines("llama")
    out = tmp_path / "grpc.json"
    with TritonServer(engine.parent / "triton_repo", log_file=tmp_path / "triton.log") as server:
        code = main(["--url", server.grpc_url, "--tokenizer", str(engine), "--concurrency", "1", "2",
                     "--requests", "3", "--input-tokens", "10", "--output-tokens", "5", "--json", str(out)])
        assert code == 0
        check_report(out, [1, 2], "concurrency", 3, 5, in_process=False)
        # with Triton's metrics endpoint, the served engine's KV cache use is reported too
        code = main(["--url", server.grpc_url, "--tokenizer", str(engine), "--concurrency", "2", "--requests", "3",
                     "--input-tokens", "40", "--output-tokens", "5", "--json", str(out),
                     "--metrics-url", f"127.0.0.1:{server.metrics_port}"])
    assert code == 0
    report = check_report(out, [2], "concurrency", 3, 5, in_process=False, kv_reported=True)
    kv = report["results"][0]["kv_cache"]  # a 45-token sequence holds 2 blocks of 32
    assert kv["blocks_used_peak_since_start"] >= 2 and kv["blocks_total"] > kv["blocks_used_peak_since_start"]


def test_nothing_listening_is_said_once_and_plainly(tiny_engines, tmp_path, capsys):
    """No server at the address: kiln generate says so and exits non-zero; kiln bench counts the
    failures and prints the reason once, not a traceback or a NaN."""
    from kiln.cli import main as kiln_main
    from kiln.triton_repo.serve import free_port

    url = f"127.0.0.1:{free_port()}"
    assert kiln_main(["generate", "--url", url, "hello"]) == 2
    assert f"cannot connect to {url} (is `kiln serve` running?)" in capsys.readouterr().err
    out = tmp_path / "down.json"
    code = main(["--url", url, "--tokenizer", str(tiny_engines("llama")), "--concurrency", "1", "--requests", "3",
                 "--input-tokens", "10", "--output-tokens", "5", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 1 and "nan" not in printed.out
    (result,) = json.loads(out.read_text())["results"]
    assert result["failed"] == 3 and list(result["error_counts"].values()) == [3]
    assert "cannot connect" in next(iter(result["error_counts"]))
