"""The benchmarks' counts (rounds, trials, steps) are whole numbers >= 1, refused as usage errors otherwise."""

from __future__ import annotations

import pytest

from benchmarks import hop, startup

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("main", "argv"), [
    # Found by review: each ended in a traceback (an empty median, min() of nothing), some after 20 s of work.
    (hop.main, ["--trials", "0"]), (hop.main, ["--round-trips", "-3"]), (hop.main, ["--trials", "x"]),
])
def test_a_count_below_one_is_a_usage_error(main: object, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(argv)  # type: ignore[operator]
    assert refused.value.code == 2 and ("below 1" in (err := capsys.readouterr().err) or "not a whole number" in err)


def test_startup_refuses_them_before_it_measures(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", ["startup", "--jobs", "0"])
    monkeypatch.setattr(startup, "measure", lambda *args: pytest.fail("measured"))
    with pytest.raises(SystemExit) as refused:
        startup.main()
    assert refused.value.code == 2 and "--jobs: 0 is below 1" in capsys.readouterr().err
