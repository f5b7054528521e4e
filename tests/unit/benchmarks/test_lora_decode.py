"""`benchmarks/lora_decode.py` on the tiny model: the merged and the unmerged forms of one
adapter give the same decode logits (fp32, within rounding), every figure is reported, and bad
arguments are refused."""

from __future__ import annotations

import pytest

from tests.unit.benchmarks.loading import load_benchmark


def test_merged_and_unmerged_decode_agree_and_every_figure_is_reported(capsys):
    bench = load_benchmark("lora_decode")
    out = bench.main(["--model", "tiny", "--dtypes", "float32", "--rank", "4", "--rows", "4",
                      "--slots", "16", "--repeats", "1"])  # fmt: skip
    assert out["fp32_max_abs_logit_diff"] < 1e-4  # W + s·AB against x W + s·(x A) B
    assert out["fp32_merged_step_s"] > 0 and out["fp32_unmerged_step_s"] > 0
    assert out["fp32_merge_s"] > 0 and out["fp32_argmax_agreement"] == 1.0
    ratio = out["fp32_unmerged_step_s"] / out["fp32_merged_step_s"]
    assert out["fp32_unmerged_over_merged_step"] == pytest.approx(ratio)
    assert "fp32_break_even_steps" in out and "bf16_merged_step_s" not in out
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")


@pytest.mark.parametrize("args", [["--dtypes", "float16"], ["--rank", "0"]])
def test_bad_arguments_are_refused(args, capsys):
    bench = load_benchmark("lora_decode")
    with pytest.raises(SystemExit) as info:
        bench.main(["--model", "tiny", *args])
    assert info.value.code == 2 and "--dtypes takes" in capsys.readouterr().err
