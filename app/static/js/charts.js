// uPlot (vendored, loaded as the global `uPlot`) line charts on a step axis.

const STEP_TICKS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04"];

export function color(index) {
  return PALETTE[index % PALETTE.length];
}

// Series of (step, value) points by label, merged onto one step axis for uPlot.
function aligned(seriesByLabel) {
  const labels = [...seriesByLabel.keys()];
  const steps = new Set();
  for (const points of seriesByLabel.values()) for (const step of points.keys()) steps.add(step);
  const xs = [...steps].sort((a, b) => a - b);
  const ys = labels.map((label) => {
    const points = seriesByLabel.get(label);
    return xs.map((step) => (points.has(step) ? points.get(step) : null));
  });
  return { labels, data: [xs, ...ys] };
}

// A chart of one metric; several labelled series (attempts, or runs) share its step axis.
// `data-points` on the element counts the points drawn, for tests and curious users.
export class StepChart {
  constructor(element, { title, height = 220 } = {}) {
    this.element = element;
    this.title = title;
    this.height = height;
    this.series = new Map(); // label -> Map(step -> value)
    this.plot = null;
    this.plotLabels = "";
    this.frame = 0;
    this.element.dataset.points = "0";
    this.element.dataset.title = title;
    this.element.classList.add("empty");
    new ResizeObserver(() => this.resize()).observe(element);
  }

  add(label, step, value) {
    if (!this.series.has(label)) this.series.set(label, new Map());
    this.series.get(label).set(step, value);
    this.scheduleDraw();
  }

  clear() {
    this.series.clear();
    this.scheduleDraw();
  }

  scheduleDraw() {
    if (!this.frame) this.frame = requestAnimationFrame(() => this.draw());
  }

  width() {
    return Math.max(this.element.clientWidth, 200);
  }

  resize() {
    this.plot?.setSize({ width: this.width(), height: this.height });
  }

  draw() {
    this.frame = 0;
    const { labels, data } = aligned(this.series);
    const key = labels.join("\u0000");
    if (!this.plot || key !== this.plotLabels) {
      this.plot?.destroy();
      this.plotLabels = key;
      this.plot = new uPlot(
        {
          title: this.title,
          width: this.width(),
          height: this.height,
          scales: { x: { time: false } },
          // Steps are whole numbers: no tick at 2.5.
          axes: [{ label: "step", incrs: STEP_TICKS }, {}],
          series: [
            { label: "step" },
            ...labels.map((label, i) => ({ label, stroke: color(i), width: 2, spanGaps: true })),
          ],
        },
        data,
        this.element,
      );
    } else {
      this.plot.setData(data);
    }
    let points = 0;
    for (const ys of data.slice(1)) points += ys.filter((y) => y !== null).length;
    this.element.dataset.points = String(points);
    this.element.classList.toggle("empty", points === 0);
  }
}

// A tiny chart without axes or legend, for a table cell. The element outlives the rows
// that show it, so a refreshed list neither flickers nor piles up charts.
export class Sparkline {
  constructor() {
    this.element = document.createElement("span");
    this.element.className = "spark";
    this.plot = null;
  }

  set(values) {
    if (values.length < 2) return;
    const data = [values.map((_, i) => i), values];
    if (this.plot) {
      this.plot.setData(data);
      return;
    }
    this.plot = new uPlot(
      {
        width: 120,
        height: 28,
        legend: { show: false },
        cursor: { show: false },
        scales: { x: { time: false } },
        axes: [{ show: false }, { show: false }],
        series: [{}, { stroke: color(0), width: 1.5, points: { show: false } }],
      },
      data,
      this.element,
    );
  }
}
