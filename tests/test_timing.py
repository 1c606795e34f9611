"""Phases of a command's wall time, counted from the process's start."""
import time

import pytest

from windowgpt_cli.timing import Phases, seconds_since_process_start


def test_the_process_started_before_this_test_and_not_long_ago():
    since = seconds_since_process_start()
    assert 0 < since < 24 * 3600


def test_phases_add_up_to_the_total_with_what_no_phase_covers_as_other():
    phases = Phases()
    with phases.timed("load"):
        time.sleep(0.02)
    with phases.timed("load"):  # a phase may repeat: its times add up
        time.sleep(0.02)
    phases.add("training", 0.5)
    out = phases.as_dict()
    assert out["start"] > 0
    assert out["load"] == pytest.approx(0.04, abs=0.02)
    assert out["other"] >= 0
    # an added phase (training, timed elsewhere) may exceed what this clock saw: other is then 0
    assert out["total"] == pytest.approx(out["start"] + out["load"] + out["other"], abs=0.01)
    assert phases.line().startswith("time: start ")
