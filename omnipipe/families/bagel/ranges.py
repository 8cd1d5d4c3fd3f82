"""The ranges of BAGEL's sampling extensions, which the router (a 400 naming the field)
and the stages (an input error) both hold. Each keeps the flow's arithmetic meaningful:

- cfg_text_scale, cfg_img_scale: 1 turns that CFG off; below 1 it would be off silently
  (the stages run CFG only above 1). Past 20 the guided velocity is the difference of two
  predictions scaled up, and the renormalisation only clips it back.
- timestep_shift: t' = s t / (1 + (s - 1) t). Toward 0 every step but the first lands
  next to t = 0, so the image is made in one jump from noise (black); BAGEL uses 1 to 5,
  and past 10 the last step jumps most of the way from noise to the image.
- cfg_interval [start, end]: CFG applies where start < t <= end, so 0 <= start < end <= 1;
  start >= end is an empty interval and CFG would silently never apply.
- cfg_renorm_min: the least the renormalisation may scale the CFG velocity, 0 to 1.
"""

from __future__ import annotations

from typing import Final

MIN_CFG_SCALE: Final = 1.0
MAX_CFG_SCALE: Final = 20.0
MIN_TIMESTEP_SHIFT: Final = 1.0
MAX_TIMESTEP_SHIFT: Final = 10.0
MIN_RENORM: Final = 0.0
MAX_RENORM: Final = 1.0
MIN_STEPS: Final = 2
MAX_STEPS: Final = 200

# field -> (lowest, highest, default)
SCALAR_RANGES: Final = {
    "cfg_text_scale": (MIN_CFG_SCALE, MAX_CFG_SCALE, 4.0),
    "cfg_img_scale": (MIN_CFG_SCALE, MAX_CFG_SCALE, 1.0),
    "cfg_renorm_min": (MIN_RENORM, MAX_RENORM, 0.0),
    "timestep_shift": (MIN_TIMESTEP_SHIFT, MAX_TIMESTEP_SHIFT, 3.0),
}
DEFAULT_CFG_INTERVAL: Final = (0.4, 1.0)


def _shown(value: float) -> str:
    """A number for a message: short whatever its size (an int of 400 digits)."""
    try:
        return f"{float(value):g}"
    except OverflowError:
        return "a number too large"


def scalar_problem(key: str, value: object) -> str | None:
    """Why `value` is no `key`, or None when it is one."""
    low, high, _ = SCALAR_RANGES[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key}: must be a number from {low:g} to {high:g}"
    if not low <= value <= high:  # NaN fails this too
        return f"{key}: must be from {low:g} to {high:g}, got {_shown(value)}"
    return None


def interval_problem(value: object) -> str | None:
    """Why `value` is no cfg_interval, or None when it is one."""
    rule = "cfg_interval: two numbers [start, end] with 0 <= start < end <= 1"
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    ):
        return rule
    start, end = value
    if not 0 <= start < end <= 1:
        return f"{rule}, got [{_shown(start)}, {_shown(end)}]"
    return None
