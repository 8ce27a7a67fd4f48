"""Progress output of the initial copy, without servers: bars on a terminal, lines elsewhere, silence on request."""

from __future__ import annotations

import io
import logging

from tablesync.progress import CopyProgress, bar, human_bytes, human_duration


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_mode_follows_the_setting_and_the_stream():
    assert CopyProgress.for_setting(None, Tty()).mode == "bars"
    assert CopyProgress.for_setting(None, io.StringIO()).mode == "lines"
    assert CopyProgress.for_setting(True, io.StringIO()).mode == "bars"
    assert CopyProgress.for_setting(False, Tty()).mode == "lines"


def test_formatting_helpers():
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 kB" and human_bytes(3 << 30) == "3.0 GB"
    assert human_duration(59.6) == "1:00" and human_duration(3725) == "1:02:05"
    assert bar(0.5, 10) == "#####-----" and bar(2, 4) == "####" and bar(-1, 4) == "----"


def test_lines_mode_reports_each_finished_table_once_and_a_summary():
    out = io.StringIO()
    p = CopyProgress("lines", out, interval=3600)
    p.start({"public.a": {0: 10, 1: 10}, "public.b": {0: 1}})
    p.update({"public.a": {0: (100, 1000)}})
    assert "public.a: done" not in out.getvalue()
    p.update({"public.a": {0: (100, 1000), 1: (50, 500)}, "public.b": {0: (1, 10)}})
    p.update({"public.a": {0: (100, 1000), 1: (50, 500)}, "public.b": {0: (1, 10)}})
    p.finish()
    text = out.getvalue()
    assert text.count("public.a: done, 150 rows") == 1 and text.count("public.b: done, 1 rows") == 1
    assert "copied 2/2 table(s), 151 rows" in text
    assert "\x1b[" not in text  # no escape codes outside a terminal


def test_bars_mode_redraws_in_place_and_notes_go_above():
    out = Tty()
    p = CopyProgress("bars", out)
    p.start({"public.a": {0: 10, 1: 30}})
    p.update({"public.a": {0: (100, 1000)}})
    assert "[####------------]  25%" in out.getvalue()  # 10 of 40 pages
    p.note("Spark UI: http://x:4040")
    assert "\x1b[2F\x1b[J" in out.getvalue()  # the two live lines are cleared before the note
    p.finish()
    assert "copied 0/1 table(s), 100 rows" in out.getvalue()


def test_off_mode_prints_nothing():
    out = Tty()
    p = CopyProgress("off", out)
    p.start({"public.a": {0: 1}})
    p.note("hello")
    p.update({"public.a": {0: (1, 1)}})
    p.finish()
    assert out.getvalue() == ""


def test_log_mode_gives_a_record_per_line_and_writes_nothing_to_the_stream(caplog, capsys):
    p = CopyProgress.to_log(logging.getLogger("t.copy"), 'subscription "s": ')
    with caplog.at_level(logging.INFO, logger="t.copy"):
        p.start({"public.a": {0: 1}})
        p.update({"public.a": {0: (7, 70)}})
        p.finish()
    assert [r.getMessage() for r in caplog.records][:2] == [
        'subscription "s": copying 1 table(s), ~8.0 kB on disk, in 1 partition(s)',
        'subscription "s": public.a: done, 7 rows, 70 B (at 0:00)',
    ]
    assert (
        caplog.records[2].getMessage().startswith('subscription "s": copied 1/1 table(s), 7 rows, 70 B in ')
    )
    assert len(caplog.records) == 3 and capsys.readouterr() == ("", "")
