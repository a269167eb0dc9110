"""A stage's log file: a rerun that Snakemake starts beside a live stage (and that the stage's
hold on its directory refuses) removes the job's log before it runs; the live stage's lines
then went on into a file no path named, and the path showed only the refusal."""

from __future__ import annotations

import logging
import os

import pytest

from eaglet.stages.scripting import setup_logging


def test_a_live_stages_log_lines_come_back_to_its_path_after_the_file_is_removed(tmp_path):
    path = tmp_path / "train.log"
    setup_logging(str(path))
    log = logging.getLogger("eaglet.train")
    try:
        log.info("step 1 of 12")
        os.remove(path)  # what the refused rerun's Snakemake did
        path.write_text("train refused: held by a live train process\n")  # the rerun's line
        log.info("step 2 of 12")
        text = path.read_text()
        assert "train refused" in text and "step 2 of 12" in text, text
    finally:
        logging.getLogger().handlers.clear()


@pytest.mark.parametrize("resumes", [True, False])
def test_an_interrupted_stage_says_whether_its_rerun_resumes_or_starts_over(
    resumes, tmp_path, capsys
):
    from eaglet.stages.scripting import RESUMES, STARTS_OVER, run_stage

    def body():
        raise KeyboardInterrupt

    log = tmp_path / "stage.log"
    with pytest.raises(SystemExit) as stopped:
        run_stage("evaluate", str(log), body, resumes=resumes)
    assert stopped.value.code == 130
    said = log.read_text()
    assert "evaluate interrupted (KeyboardInterrupt)" in said
    assert (RESUMES in said, STARTS_OVER in said) == (resumes, not resumes), said
