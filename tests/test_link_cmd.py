"""`kvlab link`: the link curve of a setup's own ranks and transport, as nccl-tests prints it, and its records;
bad sizes stop in one line. Figures are checked against each other, never against a speed."""
from __future__ import annotations

import pytest

from kvlab.config.schema import build, compose
from kvlab.core.errors import ConfigError
from kvlab.core.link_spec import LinkSpec
from kvlab.results import records


def test_sizes_follow_min_max_and_factor():
    assert LinkSpec(min_bytes=1024, max_bytes=16384, factor=2).sizes() == [1024, 2048, 4096, 8192, 16384]
    assert LinkSpec().sizes("cpu") == [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    assert LinkSpec().sizes("cuda")[0] == 1 << 20 and LinkSpec().sizes("cuda")[-1] == 1 << 30
    assert LinkSpec(max_bytes=4096).sizes() == [4096]  # below the default floor: that one size


@pytest.mark.parametrize("override, words", [
    ("link.factor=1", "link.factor=1: must be an integer >= 2"),
    ("link.min_bytes=0", "link.min_bytes=0: must be a message size in bytes > 0"),
    ("link.repeats=0", "link.repeats=0: must be a positive number of timed repeats"),
])
def test_bad_link_fields_name_the_field(override, words):
    with pytest.raises(ConfigError) as e:
        build(compose([override, "link.min_bytes=1024", "link.max_bytes=2048"][: 1 if "min" in override else 3]))
    assert str(e.value).startswith(words)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["p2p", "ipc"])
def test_kvlab_link_prints_and_records_the_curve(tmp_path, kvlab_cli, transport):
    run_dir = tmp_path / "link"
    p = kvlab_cli("link", f"transport={transport}", "link.min_bytes=65536", "link.max_bytes=1048576",
                  "link.repeats=2", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr
    header = [line for line in p.stdout.splitlines() if line.startswith("#")]
    assert any(all(w in line for w in ("size", "count", "time", "algbw", "busbw", "#wrong")) for line in header)
    points = records.read_link(run_dir)
    assert [x.size for x in points] == [65536, 262144, 1048576]
    for x in points:
        assert x.transport == transport and x.repeats == 2 and len(x.samples) == 2
        assert x.algbw_min <= x.algbw <= x.algbw_max
        if transport == "p2p":  # messages between ranks: each checked once, and none arrived different
            assert x.reference == "p2p" and x.wrong == 0 and x.pairs == 2
            assert x.busbw == pytest.approx(x.algbw * x.pairs)
            assert x.time_us == pytest.approx(x.size / (x.algbw * 1e9) * 1e6)
        else:  # a local copy: nothing crossed between ranks to check
            assert x.reference == "copy" and x.wrong is None
        line = next(ln for ln in p.stdout.splitlines() if ln.split()[:1] == [str(x.size)])
        assert line.split()[-1] == ("0" if transport == "p2p" else "n/a")
    assert not any(d.name.startswith("outputs") for d in tmp_path.iterdir())  # the run dir given, no other
