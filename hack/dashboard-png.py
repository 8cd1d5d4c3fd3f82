"""Draws a Grafana dashboard's timeseries panels from a live Prometheus into one PNG, with
Pillow alone: no Grafana server can be installed here. It does what Grafana does for each
panel (the template variables filled in from Prometheus, $__interval from the time range,
one query_range per target) and draws the series as small line charts laid out by the
panels' gridPos, with titles, legends and axes.

    python hack/dashboard-png.py --prometheus http://127.0.0.1:9090 \\
        --dashboard charts/omnipipe/files/dashboards/pipeline-overview.json \\
        --var namespace=default --var pipeline=All --from now-30m --out overview.png

tests/realnode/test_telemetry.py imports the query half (query_dashboard, empty_targets)
to prove every panel has live data, and runs this to draw
docs/images/pipeline-overview-live.png."""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

# (expr, start, end, step) -> the matrix of /api/v1/query_range.
QueryRange = Callable[[str, float, float, float], list[dict[str, Any]]]
ALL = "$__all"
# Grafana's variable syntaxes: $name, [[name:format]], ${name:format}.
VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?::([^}]+))?\}")
REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|\\]")
LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),\s*)?(\w+)\)\s*$", re.S)


# --- what Grafana does before it draws a panel


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows included."""

    def walk(items: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from walk(p.get("panels") or [])

    yield from walk(dashboard.get("panels") or [])


def round_interval(seconds: float) -> float:
    """Grafana's rangeutil.roundInterval: the step shown for range / maxDataPoints."""
    for below, step in (
        (0.015, 0.01), (0.035, 0.02), (0.075, 0.05), (0.15, 0.1), (0.35, 0.2), (0.75, 0.5),
        (1.5, 1), (3.5, 2), (7.5, 5), (12.5, 10), (17.5, 15), (25, 20), (45, 30), (90, 60),
        (210, 120), (450, 300), (1050, 600), (2100, 1200), (5400, 3600), (9000, 7200),
        (16200, 10800), (32400, 21600), (86400, 43200), (604800, 86400),
    ):  # fmt: skip
        if seconds < below:
            return step
    return 604800


def duration(seconds: float) -> str:
    """A PromQL duration: 500ms, 15s, 2m, 1h."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{round(seconds)}s"


@dataclass(frozen=True)
class Variable:
    name: str
    values: tuple[str, ...]
    all_value: str | None  # what $name becomes when All is picked with a custom value
    listed: bool  # multi or includeAll: Grafana regex-escapes and joins the values


def _escape(value: str) -> str:
    # In a PromQL string a regex escape takes two backslashes.
    return REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), value)


def format_value(var: Variable, fmt: str | None) -> str:
    """The Prometheus data source's interpolateQueryExpr, and the common :formats."""
    if var.all_value is not None and fmt in (None, "regex"):
        return var.all_value
    if fmt in ("raw", "csv"):
        return ",".join(var.values)
    if fmt == "pipe":
        return "|".join(var.values)
    if not var.listed and fmt is None:
        return var.values[0].replace("\\", "\\\\").replace("'", "\\'") if var.values else ""
    escaped = [_escape(v) for v in var.values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def interpolate(text: str, variables: Mapping[str, Variable]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(4)
        fmt = m.group(3) or m.group(5)
        var = variables.get(name)
        return m.group(0) if var is None else format_value(var, fmt)

    return VARIABLE.sub(sub, text)


def builtins(start: float, end: float, interval: float, scrape: float) -> dict[str, Variable]:
    rate = max(interval + scrape, 4 * scrape)
    values = {
        "__interval": duration(interval),
        "__interval_ms": str(round(interval * 1000)),
        "__rate_interval": duration(rate),
        "__range": duration(round(end - start)),
        "__range_s": str(round(end - start)),
        "__range_ms": str(round((end - start) * 1000)),
    }
    return {k: Variable(k, (v,), None, False) for k, v in values.items()}


def _options(
    spec: Mapping[str, Any], variables: Mapping[str, Variable], run: QueryRange, window: Window
) -> list[str]:
    kind = spec.get("type")
    query = spec.get("query")
    if kind == "query":
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        m = LABEL_VALUES.match(interpolate(text, variables))
        if m is None:
            raise ValueError(f"variable {spec['name']}: only label_values() is supported: {text}")
        selector, label = m.group(1) or f'{{{m.group(2)}!=""}}', m.group(2)
        # Grafana asks /api/v1/label/<label>/values for the time range: the same values as
        # the series that had samples in it.
        found = run(f"group by ({label}) ({selector})", window.start, window.end, window.step)
        options = sorted({s["metric"][label] for s in found if label in s["metric"]})
    elif kind == "custom":
        options = [o.strip() for o in str(query or "").split(",") if o.strip()]
    elif kind in ("constant", "textbox", "interval"):
        options = [str(query or "")]
    else:
        raise ValueError(f"variable {spec['name']}: type {kind!r} is not supported")
    pattern = spec.get("regex")
    if pattern:
        rx = re.compile(pattern.strip("/"))
        kept = [rx.search(o) for o in options]
        options = [m.group(1) if m.groups() else m.group(0) for m in kept if m]
    return options


@dataclass(frozen=True)
class Window:
    """The dashboard's time range and the step Grafana queries it with."""

    start: float
    end: float
    step: float

    @classmethod
    def of(cls, start: float, end: float, scrape: float, max_points: int = 960) -> Window:
        # maxDataPoints is the panel's width in pixels (960: half of a 1920-px screen); the
        # step is never below the data source's scrape interval, and the range is aligned
        # to it, as the Prometheus data source does.
        step = max(round_interval((end - start) / max_points), scrape)
        return cls(math.floor(start / step) * step, math.floor(end / step) * step, step)


def resolve_variables(
    dashboard: Mapping[str, Any],
    chosen: Mapping[str, Sequence[str]],
    run: QueryRange,
    window: Window,
    scrape: float,
) -> dict[str, Variable]:
    """Each template variable as Grafana fills it: its options from Prometheus, then what
    `chosen` picks ("All" or ALL for All), else Grafana's default: All where the variable
    has it, its first option otherwise. A picked value the options lack is an error: the
    dashboard's drop-down would not offer it."""
    variables = builtins(window.start, window.end, window.step, scrape)
    for spec in (dashboard.get("templating") or {}).get("list") or []:
        name = spec["name"]
        if spec.get("type") == "datasource":
            variables[name] = Variable(name, ("prometheus",), None, False)
            continue
        options = _options(spec, variables, run, window)
        listed = bool(spec.get("multi") or spec.get("includeAll"))
        picked = list(chosen.get(name) or ([ALL] if spec.get("includeAll") else options[:1]))
        if picked in (["All"], [ALL]) and spec.get("includeAll"):
            custom = spec.get("allValue") or None
            variables[name] = Variable(name, tuple(options), custom, listed)
            continue
        missing = [v for v in picked if v not in options]
        if missing:
            raise ValueError(f"variable {name}: {missing} not among its options {options}")
        variables[name] = Variable(name, tuple(picked), None, listed)
    return variables


@dataclass(frozen=True)
class Series:
    name: str
    points: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class TargetResult:
    panel: str
    ref: str
    expr: str  # as sent, variables filled in
    series: tuple[Series, ...]
    error: str | None = None

    @property
    def has_data(self) -> bool:
        return any(math.isfinite(v) for s in self.series for _, v in s.points)


@dataclass(frozen=True)
class PanelResult:
    title: str
    kind: str
    unit: str
    grid: tuple[int, int, int, int] | None  # gridPos x, y, w, h
    targets: tuple[TargetResult, ...]


def legend(fmt: str, metric: Mapping[str, str]) -> str:
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)
    labels = ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{metric.get('__name__', '')}{{{labels}}}"


def query_dashboard(
    dashboard: Mapping[str, Any],
    run: QueryRange,
    chosen: Mapping[str, Sequence[str]],
    start: float,
    end: float,
    scrape: float = 15.0,
) -> list[PanelResult]:
    """Every panel with queries, each visible target run over [start, end] as Grafana
    runs it. scrape: the data source's scrape interval (Grafana's default is 15 s)."""
    window = Window.of(start, end, scrape)
    variables = resolve_variables(dashboard, chosen, run, window, scrape)
    results = []
    for panel, bound, grid in _repeated(list(panels(dashboard)), variables):
        title = interpolate(panel.get("title", ""), bound)
        found = []
        for target in panel.get("targets") or []:
            if target.get("hide"):
                continue
            expr = interpolate(target.get("expr", ""), bound)
            try:
                matrix = run(expr, window.start, window.end, window.step)
            except Exception as exc:
                found.append(TargetResult(title, target.get("refId", ""), expr, (), str(exc)))
                continue
            series = tuple(
                Series(
                    legend(target.get("legendFormat", ""), s["metric"]),
                    tuple((float(t), float(v)) for t, v in s["values"]),
                )
                for s in matrix
            )
            found.append(TargetResult(title, target.get("refId", ""), expr, series))
        if found:
            unit = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit", "short")
            results.append(PanelResult(title, panel.get("type", ""), unit, grid, tuple(found)))
    return results


Grid = tuple[int, int, int, int]


def _repeated(
    items: Sequence[dict[str, Any]], variables: Mapping[str, Variable]
) -> Iterator[tuple[dict[str, Any], dict[str, Variable], Grid | None]]:
    """Each panel with the variables it is drawn with and its place: a panel that repeats
    for a variable is one copy per value, the variable bound to that value, side by side
    (maxPerRow a row, Grafana's default 4) or stacked; the panels below move down."""
    placed: list[tuple[dict[str, Any], dict[str, Variable], Grid | None]] = []
    pushes: list[tuple[int, int]] = []  # (below this y, move down by)
    for panel in items:
        g = panel.get("gridPos")
        grid = (g["x"], g["y"], g["w"], g["h"]) if g else None
        var = variables.get(panel.get("repeat") or "")
        if var is None or not var.values:
            placed.append((panel, dict(variables), grid))
            continue
        n = len(var.values)
        per = 1 if panel.get("repeatDirection") == "v" else min(panel.get("maxPerRow") or 4, n)
        for i, value in enumerate(var.values):
            bound = {**variables, var.name: Variable(var.name, (value,), None, var.listed)}
            copy = None
            if grid is not None:
                x, y, w, h = grid
                w = 24 // per if per > 1 else w
                copy = ((i % per) * w if per > 1 else x, y + (i // per) * h, w, h)
            placed.append((panel, bound, copy))
        if grid is not None:
            pushes.append((grid[1] + grid[3], (math.ceil(n / per) - 1) * grid[3]))
    for panel, bound, grid in placed:
        if grid is not None and not panel.get("repeat"):
            x, y, w, h = grid
            grid = (x, y + sum(dy for below, dy in pushes if y >= below), w, h)
        yield panel, bound, grid


def empty_targets(results: Sequence[PanelResult]) -> list[str]:
    """'panel [refId]: expr' for each target with no finite point, or its error."""
    return [
        f"{t.panel} [{t.ref}]: {t.expr}" + (f" ({t.error})" if t.error else "")
        for p in results
        for t in p.targets
        if not t.has_data
    ]


def http_query_range(url: str) -> QueryRange:
    def run(expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": str(start), "end": str(end), "step": str(step)}
        try:
            with urllib.request.urlopen(
                f"{url}/api/v1/query_range?{urllib.parse.urlencode(params)}", timeout=30
            ) as r:
                result: list[dict[str, Any]] = json.loads(r.read())["data"]["result"]
                return result
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{exc.code}: {exc.read().decode()}") from None

    return run


# --- drawing

WIDTH = 1800
ROW = 40  # pixels per gridPos height unit
HEADER = 56
COLORS = (
    "#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0",
    "#508642", "#CCA300", "#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62", "#584477",
)  # fmt: skip
BACKGROUND, PANEL, BORDER, TEXT, DIM, GRID = (
    "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e9e", "#25282d",
)  # fmt: skip


def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)
    except OSError:
        return ImageFont.load_default(size)


def si(value: float, base: float = 1000, prefixes: str = " kMGTP") -> tuple[float, str]:
    i = 0
    while abs(value) >= base and i < len(prefixes) - 1:
        value, i = value / base, i + 1
    return value, prefixes[i].strip()


def fmt_value(value: float, unit: str) -> str:
    if value == 0:
        return "0"
    if unit in ("s", "ms"):
        seconds = value / 1000 if unit == "ms" else value
        for size, name in ((3600, "h"), (60, "min"), (1, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if abs(seconds) >= size or size == 1e-6:
                return f"{seconds / size:.3g} {name}"
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "percent":
        return f"{value:.3g}%"
    if unit == "bytes":
        v, p = si(value, 1024, " KMGTP")
        return f"{v:.3g} {p}iB" if p else f"{v:.3g} B"
    v, p = si(value)
    if unit == "Bps":
        return f"{v:.3g} {p}B/s"
    return f"{v:.3g}{p}" + {"reqps": " req/s", "ops": " ops/s"}.get(unit, "")


def nice_step(span: float, ticks: int = 4) -> float:
    raw = span / ticks
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * power >= raw)


def draw_panel(
    img: ImageDraw.ImageDraw, box: tuple[int, int, int, int], panel: PanelResult, window: Window
) -> None:
    x0, y0, x1, y1 = box
    img.rounded_rectangle(box, 4, fill=PANEL, outline=BORDER)
    img.text((x0 + 10, y0 + 8), panel.title, fill=TEXT, font=font(15))
    series = [s for t in panel.targets for s in t.series]
    errors = [t.error for t in panel.targets if t.error]
    small = font(12)
    # The legend: swatch and name, wrapped, at most three lines.
    entries: list[tuple[float, int, str, str | None]] = []
    line, lx = 0, float(x0 + 10)
    for i, s in enumerate(series):
        w = img.textlength(s.name, font=small) + 26
        if lx + w > x1 - (80 if line == 2 else 10) and lx > x0 + 10:
            if line == 2:
                entries.append((lx, line, f"+{len(series) - i} more", None))
                break
            line, lx = line + 1, float(x0 + 10)
        entries.append((lx, line, s.name, COLORS[i % len(COLORS)]))
        lx += w
    legend_h = 16 * (line + 1) + 6
    px0, py0, px1, py1 = x0 + 70, y0 + 44, x1 - 14, y1 - legend_h - 22
    for lx, line, name, color in entries:
        ly = y1 - legend_h + 16 * line
        if color:
            img.rectangle((lx, ly + 5, lx + 14, ly + 8), fill=color)
        img.text((lx + (20 if color else 0), ly), name, fill=DIM, font=small)
    values = [v for s in series for _, v in s.points if math.isfinite(v)]
    if not values:
        msg = errors[0][:120] if errors else "No data"
        img.text(((px0 + px1) / 2, (py0 + py1) / 2), msg, fill=DIM, font=font(14), anchor="mm")
        return
    lo, hi = min(min(values), 0.0), max(values)
    if hi <= lo:
        hi = lo + 1
    step = nice_step(hi - lo)
    lo, hi = math.floor(lo / step) * step, math.ceil(hi / step) * step

    def xy(t: float, v: float) -> tuple[float, float]:
        span = max(window.end - window.start, 1e-9)
        return (
            px0 + (t - window.start) / span * (px1 - px0),
            py1 - (v - lo) / (hi - lo) * (py1 - py0),
        )

    tick = lo
    while tick <= hi + step / 2:
        _, y = xy(window.start, tick)
        img.line((px0, y, px1, y), fill=GRID)
        img.text((px0 - 6, y), fmt_value(tick, panel.unit), fill=DIM, font=small, anchor="rm")
        tick += step
    span = window.end - window.start
    every = next(
        (s for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600) if s >= span / 8),
        7200,
    )
    at = float(math.ceil(window.start / every) * every)
    while at <= window.end:
        x, _ = xy(at, lo)
        img.line((x, py1, x, py1 + 4), fill=BORDER)
        label = datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S" if every < 60 else "%H:%M")
        if x + img.textlength(label, font=small) / 2 < x1 - 4:
            img.text((x, py1 + 6), label, fill=DIM, font=small, anchor="mt")
        at += every
    img.line((px0, py1, px1, py1), fill=BORDER)
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        run_: list[tuple[float, float]] = []
        last = None
        for t, v in (*s.points, (math.inf, math.nan)):
            # A missing step or a NaN breaks the line, as Grafana leaves a gap.
            if not math.isfinite(v) or (last is not None and t - last > 1.5 * window.step):
                if len(run_) > 1:
                    img.line(run_, fill=color, width=2)
                elif run_:
                    (x, y), r = run_[0], 3
                    img.ellipse((x - r, y - r, x + r, y + r), fill=color)
                run_ = []
            if math.isfinite(v):
                run_.append(xy(t, v))
            last = t


def draw(
    title: str, results: Sequence[PanelResult], window: Window, subtitle: str, out: Path
) -> None:
    """The timeseries panels where their gridPos puts them (two a row without one)."""
    shown = [p for p in results if p.kind == "timeseries"]
    col = WIDTH / 24
    boxes = []
    for i, p in enumerate(shown):
        x, y, w, h = p.grid or ((i % 2) * 12, (i // 2) * 8, 12, 8)
        boxes.append((round(x * col) + 6, HEADER + y * ROW + 6, round((x + w) * col) - 6,
                      HEADER + (y + h) * ROW - 6))  # fmt: skip
    height = max((b[3] for b in boxes), default=HEADER) + 10
    image = Image.new("RGB", (WIDTH, height), BACKGROUND)
    canvas = ImageDraw.Draw(image)
    canvas.text((14, 10), title, fill=TEXT, font=font(20))
    canvas.text((14, 36), subtitle, fill=DIM, font=font(13))
    for box, panel in zip(boxes, shown, strict=True):
        draw_panel(canvas, box, panel, window)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, optimize=True)


def parse_time(text: str, now: float) -> float:
    m = re.fullmatch(r"now(?:-(\d+)([smhd]))?", text)
    if m:
        n, unit = m.groups()
        return now - (int(n) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit] if n else 0)
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text).timestamp()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="base URL of the Prometheus")
    parser.add_argument("--dashboard", required=True, type=Path, help="the dashboard's JSON")
    parser.add_argument(
        "--var", action="append", default=[], help="NAME=VALUE[,VALUE...] or NAME=All"
    )
    parser.add_argument("--from", dest="start", default="now-1h", help="now-15m, epoch, ISO")
    parser.add_argument("--to", dest="end", default="now")
    parser.add_argument(
        "--scrape-interval", type=float, default=15.0, help="the data source's, seconds"
    )
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    now = time.time()
    start, end = parse_time(args.start, now), parse_time(args.end, now)
    chosen = {k: v.split(",") for k, _, v in (a.partition("=") for a in args.var)}
    dashboard = json.loads(args.dashboard.read_text())
    results = query_dashboard(
        dashboard, http_query_range(args.prometheus), chosen, start, end, args.scrape_interval
    )
    window = Window.of(start, end, args.scrape_interval)
    picked = "  ".join(f"{k}={','.join(v)}" for k, v in chosen.items())
    when = (
        f"{datetime.fromtimestamp(start, UTC):%Y-%m-%d %H:%M:%S} to "
        f"{datetime.fromtimestamp(end, UTC):%H:%M:%S} UTC, step {duration(window.step)}"
    )
    draw(dashboard.get("title", ""), results, window, f"{picked}   {when}", args.out)
    for line in empty_targets(results):
        print(f"no data: {line}")


if __name__ == "__main__":
    main()
