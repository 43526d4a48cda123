"""evaluation.suite_log: a suite log's jobs, batches and phases summed, across the logs of several calls."""

from __future__ import annotations

import pytest

from evaluation.suite_log import job_name, loaded_at, main, read_logs, table

CALL1 = (
    "Loading weights: 100%|###| 339/339\r[suite] qwen2.5-coder-1.5b loaded (t+40.0 s)\n"
    "[suite] perplexity 8192  dense,quest @ 1/8 (t+41.5 s)\n"
    "[suite] needle 8192 {'variant': 'single'} dense,quest @ 1/8,1/16 (t+60.0 s)\n"
    "[suite]   needle 8192: 16 prompts x 3 cells: build 0.50 s, prefill 4.00 s, copy 0.25 s, decode 10.00 s\n"
    "[suite]     per cell: quest@1/8 6.00 s (2 graphs 5.50 s), dense@- 3.00 s (1 graphs 2.00 s), quest@1/16 0.50 s\n"
    "[suite]   needle 8192: 4 prompts x 3 cells: build 0.00 s, prefill 1.00 s, copy 0.25 s, decode 1.00 s\n"
    "[suite]     per cell: quest@1/8 0.40 s, dense@- 0.30 s, quest@1/16 0.30 s\n"
    "[suite] needle 32768 {'variant': 'multi_key'} dense,quest @ 1/8 (t+80.0 s)\n"
    "[suite]   needle 32768: 8 prompts x 2 cells: build 1.00 s, prefill 3.50 s, copy 0.50 s, decode 1.00 s\n"
    "[suite]     per cell: dense@- 0.50 s (1 graphs 0.25 s), quest@1/8 0.50 s\n"
    "[suite] stopped by the time limit: {'finished': False}\n"
)
CALL2 = (  # the next call resumes the same job: it sums across both logs
    "[suite] needle 32768 {'variant': 'multi_key'} dense,quest @ 1/8 (t+30.0 s)\n"
    "[suite]   needle 32768: 8 prompts x 2 cells: build 0.00 s, prefill 3.50 s, copy 0.50 s, decode 1.00 s\n"
    "[suite] qa 32768  dense @ - (t+45.0 s)\n"
    "[suite]   qa 32768: 8 prompts x 1 cells: build 0.00 s, prefill 3.00 s, copy 0.00 s, decode 0.50 s\n"
)


def test_job_name_reads_task_variant_and_length():
    assert job_name("[suite] needle 8192 {'variant': 'multi_value'} dense @ 1/8 (t+1.0 s)") == "needle multi_value 8192"
    assert job_name("[suite] qa 32768  dense,quest @ 1/8") == "qa 32768"
    assert job_name("[suite]   needle 8192: 16 prompts x 3 cells: build 0.50 s, ...") is None  # a batch line
    assert job_name("[suite] stopped by the time limit: {'finished': False}") is None


def test_read_logs_sums_each_job_across_calls(tmp_path):
    a, b = tmp_path / "call1.txt", tmp_path / "call2.txt"
    a.write_text(CALL1)
    b.write_text(CALL2)
    jobs = {j.name: j for j in read_logs([a, b])}
    assert list(jobs) == ["perplexity 8192", "needle single 8192", "needle multi_key 32768", "qa 32768"]
    single = jobs["needle single 8192"]
    assert (single.batches, single.prompts, single.started) == (2, 20, 60.0)
    assert single.seconds == {"build": 0.5, "prefill": 5.0, "copy": 0.5, "decode": 11.0}
    assert single.first == {"build": 0.5, "prefill": 4.0, "copy": 0.25, "decode": 10.0}
    assert (single.graphs, single.capture) == (3, 7.5) and single.total == pytest.approx(17.0)
    multi = jobs["needle multi_key 32768"]
    assert (multi.batches, multi.started, multi.graphs) == (2, 80.0, 1)  # started: where it first appeared
    assert multi.seconds["prefill"] == pytest.approx(7.0)
    assert jobs["perplexity 8192"].batches == 0 and jobs["perplexity 8192"].started == 41.5
    md = table(list(jobs.values()))
    assert "| needle single 8192 | 60.0 | 20.0 | 2 | 20 | 0.5 | 5.0 | 0.5 | 11.0 | 17.0 | 14.8 | 3 (7.5) |" in md
    # the call stopped without its seconds: multi-key's first part has no end, so neither has its wall, nor the sum
    assert "| needle multi_key 32768 | 80.0 | – |" in md and "| perplexity 8192 | 41.5 | 18.5 | 0 |" in md
    assert md.splitlines()[-1].startswith("| **all** | | – | 5 | 44 | 1.5 | 15.0 |")
    assert loaded_at([a, b]) == [40.0]


def test_wall_runs_from_a_job_stamp_to_the_next_or_to_the_runs_end(tmp_path):
    """A job's wall: its start stamp to the next job's, or to the ``seconds`` of the run's last line; summed over the
    logs a job spans; unknown (``–``) where a part has no end."""
    log = tmp_path / "run.txt"
    log.write_text(
        "[suite] perplexity 8192  dense @ 1/8 (t+10.0 s)\n"
        "[suite] needle 8192 {'variant': 'single'} dense @ 1/8 (t+25.5 s)\n"
        "[suite]   needle 8192: 4 prompts x 1 cells: build 0.00 s, prefill 1.00 s, copy 0.00 s, decode 2.00 s\n"
        "[suite] finished: {'finished': True, 'jobs_done': 2, 'jobs': 2, 'seconds': 30.0, 'date': '2026-12-06'}\n"
    )
    jobs = read_logs([log])
    assert [(j.name, j.wall_known) for j in jobs] == [("perplexity 8192", 15.5), ("needle single 8192", 4.5)]
    assert table(jobs).splitlines()[-1].startswith("| **all** | | 20.0 | 1 | 4 |")
    later = tmp_path / "later.txt"  # the needle job resumed by another process: 2.0 s more
    later.write_text(
        "[suite] needle 8192 {'variant': 'single'} dense @ 1/8 (t+3.0 s)\n"
        "[suite] stopped by the time limit: {'finished': False, 'jobs_done': 0, 'jobs': 2, 'seconds': 5.0}\n"
    )
    assert read_logs([log, later])[1].wall_known == pytest.approx(6.5)
    assert loaded_at([log, later]) == []


def test_main_prints_the_table_and_refuses_a_missing_log(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text(CALL1)
    main([str(log)])
    assert "| needle single 8192 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope.txt")])
    assert "no such log" in capsys.readouterr().err
