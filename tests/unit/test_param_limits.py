"""A stage's published limits, as the router and the stage both check them."""

from __future__ import annotations

import pytest

from omnipipe.api.param_limits import ParamLimit, StageLimits, exceeded
from omnipipe.stagekit.stage import StageInputError, check_param_limits

SIDE = ParamLimit(param="width", maximum=1024, field="size", why="at most 1024 pixels a side")
FRAMES = ParamLimit(param="num_frames", maximum=253, field="seconds", why="at most 253 frames")


def test_the_first_limit_a_number_goes_past_is_named() -> None:
    assert exceeded({"width": 1024, "num_frames": 253}, [SIDE, FRAMES]) is None
    assert exceeded({"width": 1025, "num_frames": 254}, [SIDE, FRAMES]) is SIDE
    assert exceeded({"width": 16, "num_frames": 253.5}, [SIDE, FRAMES]) is FRAMES


@pytest.mark.parametrize("value", [None, "4096", True, [4096]])
def test_what_is_not_a_number_is_left_to_the_parameters_own_checks(value: object) -> None:
    assert exceeded({"width": value}, [SIDE]) is None


def test_the_stage_refuses_with_the_routers_words_and_field() -> None:
    with pytest.raises(StageInputError) as refused:
        check_param_limits({"width": 2048}, [SIDE])
    assert refused.value.message == "width 2048: at most 1024 pixels a side"
    assert refused.value.param == "size"


def test_the_wire_form_round_trips_and_refuses_strangers() -> None:
    sent = StageLimits(stage="denoise", limits=(SIDE, FRAMES))
    assert StageLimits.model_validate_json(sent.model_dump_json()) == sent
    with pytest.raises(ValueError, match="extra"):
        StageLimits.model_validate({"stage": "denoise", "limits": [], "more": 1})
