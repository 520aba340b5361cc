"""The LSH / relative / paged benchmark runs and reports every implementation (tiny CPU sizes)."""
import pytest

from benchmarks import lsh_relative_paged

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_benchmark_rows(tmp_path):
    rows = lsh_relative_paged.main(["--lengths", "64", "--heads", "1", "--head-dim", "16", "--budget", "0.01",
                                    "--csv", str(tmp_path / "out.csv")])
    impls = {(r["kind"], r["impl"]) for r in rows}
    assert impls == {("lsh", "lsh-torch"), ("lsh", "dense"), ("relative", "relative-torch"),
                     ("relative", "unfused-reference"), ("paged", "paged-gather"), ("paged", "contiguous")}
    assert all(r["error"] == "" and r["ms"] > 0 for r in rows)
    assert (tmp_path / "out.csv").read_text().startswith("kind,impl,length")
