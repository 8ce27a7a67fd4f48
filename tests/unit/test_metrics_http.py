"""The ``/metrics`` endpoint: a counter file a worker is still creating does not fail the scrape, and a scrape that
fails anyway answers 500 with one log record, never a bare traceback on stderr (which broke ``--log-format json``:
CI saw it once, from a scrape that met a worker's new file)."""

from __future__ import annotations

import logging
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from applier.metrics_http import ReadyFilesCollector, ready_files, start_server
from applier.testing.cluster import free_port


def _counter_file(path: Path, value: float) -> None:
    """A counter file as a worker writes it (header, one value)."""
    d = MmapedDict(str(path))
    d.write_value(mmap_key("applier_x_total", "applier_x_total", ["subscription"], ["s1"], "x"), value, 0.0)
    d.close()


def test_a_counter_file_being_created_is_left_out_until_it_has_its_header(tmp_path: Path) -> None:
    _counter_file(tmp_path / "counter_101.db", 7.0)
    (tmp_path / "counter_102.db").touch()  # a worker between open() and sizing the file
    with pytest.raises(struct.error):  # what prometheus_client's own collector does with it
        generate_latest(_registry(MultiProcessCollector, tmp_path))
    text = generate_latest(_registry(ReadyFilesCollector, tmp_path)).decode()
    assert 'applier_x_total{subscription="s1"} 7.0' in text
    assert ready_files(str(tmp_path)) == [str(tmp_path / "counter_101.db")]

    _counter_file(tmp_path / "counter_102.db", 5.0)  # sized and written: counted from the next scrape on
    text = generate_latest(_registry(ReadyFilesCollector, tmp_path)).decode()
    assert 'applier_x_total{subscription="s1"} 12.0' in text


def _registry(collector: type[MultiProcessCollector], path: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    collector(registry, path=str(path))
    return registry


class _Broken:
    def collect(self) -> Iterator[Metric]:
        raise RuntimeError("the collector broke")


def test_a_failing_scrape_answers_500_and_logs_instead_of_printing(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    registry = CollectorRegistry()
    registry.register(_Broken())  # type: ignore[arg-type]
    port = free_port()
    server = start_server(registry, port, "127.0.0.1")
    try:
        with caplog.at_level(logging.ERROR, logger="applier.metrics"):
            with pytest.raises(urllib.error.HTTPError) as failed:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert failed.value.code == 500
        assert b"the applier's log says why" in failed.value.read()
    finally:
        server.shutdown()
        server.server_close()
    assert capsys.readouterr().err == ""
    (record,) = [r for r in caplog.records if r.name == "applier.metrics"]
    assert record.exc_info is not None and "the collector broke" in str(record.exc_info[1])
