"""The analysis as rich terminal tables (and ``build_report``, the contract-4 document of a
run in one call). The document itself is built by ``pptrace.analysis``; this file formats."""
from __future__ import annotations

from ..analysis import analyze
from ..ingest.comm_kernels import describe as describe_kernels
from ..vocab import COMM_DIMS, PARTS


def build_report(run, steps=None, ranks=None) -> dict:
    """The contract-4 document of a loaded run: ``pptrace.analyze(run, steps=, ranks=).to_json()``."""
    return analyze(run, steps=steps, ranks=ranks).to_json()


# -------------------------------------------------------------------------------------------
# terminal
# -------------------------------------------------------------------------------------------
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _n(x) -> str:
    """A count or byte figure (a per-step mean): whole numbers without a fraction."""
    if x is None:
        return "-"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _header(part: str) -> str:
    """A step part as a column header: words, so that the header wraps instead of widening
    the column ("tp_exposed" -> "tp exposed")."""
    return part.replace("_", " ")


#: What each column means, per table: (headers, short or None, long). The legend under the
#: tables gives the short text of the columns shown; ``--explain`` the long text of each.
LEGEND = {
    "stages": ("Pipeline bubble per stage", [
        (("stage",), None, "pipeline stage (its ranks are those with this pp coordinate)"),
        (("step",), None, "mean step wall time of the stage's ranks"),
        (("bubble",), "idle, waiting for another stage",
         "mean pp_bubble per step of the stage's ranks: receives waiting for the peer stage to "
         "send, and the step-end all-reduce waiting while the pipeline drains"),
        (("frac",), None, "bubble / step"),
        (("schedule",), "the part of it the schedule causes (compare with theory)",
         "bubble_schedule_s: what a replay of the step in its measured order, with free p2p and no "
         "host gaps, leaves idle; the number to compare with theory"),
        (("latency",), "the part p2p latency and host gaps add",
         "bubble_latency_s = bubble - schedule: idle time owed to p2p latency and host gaps on the "
         "critical path (every stage idles through it)"),
        (("theory", "theory frac"), "the schedule's bubble with these pass times and free p2p",
         "theory_bubble_s: the schedule's closed form (GPipe and 1F1B (p-1)(t_fwd+t_bwd), "
         "interleaved the same / vpp, ZB-H1 less the weight-gradient passes) or a zero-latency "
         "replay of its action order, fed this run's measured pass times (the line under the "
         "table says which); theory frac = theory / step"),
        (("warm-up", "steady", "cool-down"), "bubble before the first backward / to the last forward / after",
         "the bubble by phase: before the stage's first backward (the pipeline filling), from "
         "there to its last forward (steady state), after it (the pipeline draining)"),
        (("t_fwd", "t_bwd", "t_w"), "median forward / backward / weight-gradient pass of one microbatch",
         "median over ranks, steps and microbatches of one microbatch's forward, whole backward "
         "(input and weight gradient), and weight-gradient pass alone (zero-bubble schedules run "
         "it apart; 0 otherwise)"),
    ]),
    "ranks": ("Step time per rank", [
        (("rank",), None, "global rank"),
        (("where",), "pipeline stage, tp/cp/dp index",
         "the rank's layout coordinates: pp stage, then its tp, cp and dp index where that size is over 1"),
        (("step",), "compute to other add up to it",
         "step wall time (ProfilerStep#N; on GPU traces, of the GPU work it launched); the columns "
         "from compute to other are its parts and add up to it"),
        (("compute",), None, "compute ranges (forward, backward, optimizer...) or compute kernels"),
        (tuple(_header(f"{d}_exposed") for d in COMM_DIMS),
         "communication with no compute under it (it lengthens the step)",
         "breakdown_s.<dim>_exposed: time in tp (tensor), cp (context), dp (data) or ep (expert) "
         "parallel communication while nothing computed"),
        ((_header("pp_transfer"),), "p2p moving data",
         "breakdown_s.pp_transfer: pipeline send/recv time once both sides had posted, and p2p "
         "that could not be paired"),
        ((_header("pp_bubble"),), "waiting for another stage", "breakdown_s.pp_bubble: see bubble above"),
        ((_header("pp_bubble_or_transfer"),), "p2p whose peer --ranks left out: bubble or transfer, unknown which",
         "breakdown_s.pp_bubble_or_transfer: pp_bubble and pp_transfer together, on a rank whose p2p peer "
         "--ranks left out: telling the two apart needs the peer's trace, so both are unknown (-)"),
        (("other",), "host gaps, unannotated work",
         "breakdown_s.other: step time in none of the above (host gaps, unannotated work, "
         "memcpy on GPU traces)"),
        (tuple(f"{d} hidden" for d in COMM_DIMS), "communication under compute (not part of step)",
         "hidden_s.<dim>: that dimension's communication while compute ran; not one of the parts "
         "that add up to step"),
    ]),
    "links": ("Pipeline p2p links", [
        (("src", "dst"), None, "sending and receiving rank"),
        (("count", "bytes"), None, "messages and bytes per step (mean over steps)"),
        (("wait ms",), "a receive waiting for its send (bubble)",
         "time a message waited until both sides had posted (and the exchange's last message "
         "too); part of pp_bubble, not of communication"),
        (("transfer ms",), "moving data once both sides had posted",
         "time from both sides posted until the first side was done; pp_transfer"),
        (("GB/s",), None, "bytes / transfer time over the messages whose transfer was exposed (at least "
         "half of their moving time not under a pass): the rate once both sides were ready"),
    ]),
    "collectives": ("Collectives by dimension", [
        (("dim",), None, "parallel dimension of the process group"),
        (("count", "bytes"), None, "collectives and bytes per rank per step (mean)"),
        (("time ms",), None, "time collectives were in progress, launch to completion"),
        (("exposed ms", "hidden ms"), "with no compute under it / under compute",
         "the part of time with nothing computing (<dim> exposed in the step) / under compute (<dim> hidden)"),
        (("wait ms",), "waiting for the group's last rank",
         "time from the rank's arrival to the last rank's (the step-end all-reduce is left out: "
         "its wait is the pipeline draining)"),
        (("transfer ms",), None, "the rest of the time until the rank left"),
        (("ops",), None, "each collective and how many of it per rank per step"),
    ]),
    "experts": ("Expert load", [
        (("rank", "ep group"), None, "a rank with MoE experts and the ranks of its expert-parallel group"),
        (("tokens",), None, "tokens its experts processed per step (forward; from the compute:expert ranges)"),
        (("x mean",), "over its ep group's mean", "its tokens over the mean of its ep group's ranks"),
        (("wait cost ms",), "what the group waited for its hottest rank",
         "on the group's hottest rank (at least 1.1x the mean): the others' ep wait per step beyond its own, "
         "mean over them: the cost of the imbalance"),
        (("waits most for",), "the ep peer it waited for longest (ms per step)",
         "from the ep rank-pair matrix: in each all-to-all a rank waits for the last peer to arrive; the "
         "peer it waited for longest per step, and how long (the --json's ep.pairs hold every pair)"),
    ]),
    "stragglers": ("Stragglers", [
        (("rank",), None, "the straggler; the one that costs most first"),
        (("metric",), "compute: computes longer than the median rank; collective_arrival: last at collectives",
         "compute: the rank computes longer per step than the median rank (its stage paces every "
         "microbatch round, its dp group waits for it); collective_arrival: it is the last to "
         "arrive at collectives"),
        (("slowdown",), None, "compute: its compute over the median rank's, minus 1; "
         "collective_arrival: share of its collectives where it came last"),
        (("cost ms/step",), "step time it costs the others",
         "compute: its compute beyond the median rank's; collective_arrival: how long the group "
         "waited for it alone (last minus second-last arrival)"),
        (("evidence",), "in how many steps it was late, by how much, against the run's own spread",
         "a rank is named only when it is late in most profiled steps by more than three times the "
         "run's own spread (step to step, and across ranks): OS scheduling noise on an oversubscribed "
         "machine makes single slow steps, not persistent stragglers"),
    ]),
}
CRITICAL_PATH_LEGEND = ("critical path: per step, the chain of work across ranks that set the step "
                        "time, and what it was made of")


def _names(names) -> str:
    """("tp exposed", "cp exposed") -> "tp, cp exposed"; other groups joined by " / "."""
    tails = {n.partition(" ")[2] for n in names}
    if len(names) > 1 and len(tails) == 1 and all(n.partition(" ")[0] in COMM_DIMS for n in names):
        return ", ".join(n.partition(" ")[0] for n in names) + f" {tails.pop()}"
    return " / ".join(names)


def print_legend(console, shown: dict, explain: bool = False) -> None:
    """The legend of the tables printed (``shown``: table key -> headers): the jargon in a few
    lines, or with ``explain`` every column of them."""
    from rich.markup import escape
    from rich.padding import Padding
    from rich.text import Text

    def entry(label: str, text: str) -> None:
        line = Text.assemble((label, "bold"), text)
        console.print(Padding(line, (0, 0, 0, 2), expand=False), highlight=False)

    if explain:
        console.print("\n[bold]Columns[/] (ms: milliseconds per step, mean over the profiled steps)")
    else:
        console.print("\n[bold]legend[/] (ms per step, mean over steps; every column: pptrace analyze --explain)")
    for key, (title, entries) in LEGEND.items():
        headers = set(shown.get(key) or ())
        # a group is named whole (its text speaks of each), also when a column of it was left out
        picked = [(names, short, long) for names, short, long in entries if headers & set(names)]
        if explain and picked:
            console.print(f"[bold]{escape(title)}[/]")
            for names, _, long in picked:
                entry(f"{_names(names)}: ", long)
        elif picked:
            text = "; ".join(f"{_names(names)} = {short}" for names, short, _ in picked if short)
            if text:
                entry(f"{title}: ", text)
    if explain and shown.get("critical_path"):
        entry("", CRITICAL_PATH_LEGEND)


def _most_waited(report: dict) -> dict:
    """rank -> "peer (ms)": the ep peer each rank waited for longest per step."""
    best: dict = {}
    for pair in (report.get("ep") or {}).get("pairs") or []:
        wait = pair.get("wait_s") or 0
        if wait > 0 and wait > best.get(pair["src"], (None, 0))[1]:
            best[pair["src"]] = (pair["dst"], wait)
    return {src: f"{dst} ({_ms(wait)})" for src, (dst, wait) in best.items()}


def print_report(report: dict, console, explain: bool = False) -> None:
    """Tables, one per view: pipeline stages, per-rank breakdown (mean over steps, ms), p2p
    links, collectives by dim, stragglers; then warnings and a legend of the columns shown
    (``explain``: every column at length). Tables fit the console's width and never cut a
    value (export/tables.py)."""
    from rich.markup import escape

    from .tables import Col, print_table, printable

    shown: dict = {}
    info = report["run"]
    lay = info["layout"]
    console.print(
        f"[bold]pptrace analysis[/] world {info['world_size']} (tp{lay['tp']} cp{lay['cp']} "
        f"pp{lay['pp']} dp{lay['dp']}), schedule {info['schedule'] or '?'}, microbatches "
        f"{info['microbatches'] or '?'}, vpp {info['vpp'] or 1}, steps {info['steps']}"
    )
    if info.get("inferred"):
        console.print("[bold]inferred[/] (the run carries no pptrace metadata): " + "; ".join(
            f"{escape(str(k))}: {escape(str(v))}" for k, v in info["inferred"].items()), highlight=False)
    if info.get("comm_kernels"):
        console.print("[bold]communication kernels[/] known by name: " + escape(describe_kernels(info["comm_kernels"])),
                      highlight=False)
    pipe = report["pipeline"]
    if pipe["stages"] and lay["pp"] > 1:
        cols = [Col("stage", key=True), *(Col(h) for h in (
            "step", "bubble", "frac", "schedule", "latency", "theory", "theory frac", "warm-up", "steady",
            "cool-down", "t_fwd", "t_bwd", "t_w"))]
        rows = [[str(s["stage"]), _ms(s["step_s"]), _ms(s["bubble_s"]), _pct(s["bubble_fraction"]),
                 _ms(s.get("bubble_schedule_s")), _ms(s.get("bubble_latency_s")),
                 _ms(s.get("theory_bubble_s")), _pct(s.get("theory_bubble_fraction")),
                 _ms(s["warmup_bubble_s"]), _ms(s["steady_bubble_s"]), _ms(s["cooldown_bubble_s"]),
                 _ms(s["t_fwd_s"]), _ms(s["t_bwd_s"]), _ms(s["t_wgrad_s"])] for s in pipe["stages"]]
        if pipe.get("theory_source"):
            caption = f"theory: {pipe['theory_source']} with this run's measured pass times"
        elif pipe.get("theory_unknown"):
            caption = f"theory: unknown ({pipe['theory_unknown']})"
        else:
            caption = "theory: unknown (no closed form for this schedule and no pass order to replay)"
        shown["stages"] = print_table(
            console, f"Pipeline bubble per stage (ms) — measured {_pct(pipe['bubble_fraction'])} vs "
                     f"theory {_pct(pipe['theory_bubble_fraction'])} of the step", cols, rows, caption=caption)
    for bound in report.get("critical_path") or ():
        shown["critical_path"] = True
        console.print(f"[bold]critical path[/] {escape(bound['summary'])}", highlight=False)
    cols = [Col("rank", key=True), Col("where", key=True, justify="left"), Col("step", drop_zero=False),
            *(Col(_header(p)) for p in (*PARTS, "pp_bubble_or_transfer")), *(Col(f"{d} hidden") for d in COMM_DIMS)]
    rows = []
    for r in report["ranks"]:
        m = r["mean"]
        if m is None:
            continue
        rows.append([str(r["rank"]), r.get("describe") or "", _ms(m["time_s"]),
                     *(_ms(m["breakdown_s"].get(p)) for p in (*PARTS, "pp_bubble_or_transfer")),
                     *(_ms(m["hidden_s"][d]) for d in COMM_DIMS)])
    shown["ranks"] = print_table(console, "Step time per rank (ms, mean over steps)", cols, rows)
    p2p = report["p2p"]
    if p2p["links"]:
        cols = [Col("src", key=True), Col("dst", key=True),
                *(Col(h) for h in ("count", "bytes", "wait ms", "transfer ms", "GB/s"))]
        rows = []
        for link in p2p["links"]:
            bw = link.get("bandwidth_gbps")
            rows.append([str(link["src"]), str(link["dst"]), _n(link["count"]), _n(link["bytes"]),
                         _ms(link["wait_s"]), _ms(link["transfer_s"]), "-" if bw is None else f"{bw:.3f}"])
        shown["links"] = print_table(
            console, f"Pipeline p2p links (per step): {_n(p2p['pairs'])} pairs, wait {_ms(p2p['wait_s'])} ms, "
                     f"transfer {_ms(p2p['transfer_s'])} ms", cols, rows)
    if report["collectives"]:
        cols = [Col("dim", key=True), *(Col(h) for h in ("count", "bytes", "time ms", "exposed ms", "hidden ms",
                                                         "wait ms", "transfer ms")),
                Col("ops", wrap=True, justify="left")]
        rows = []
        for c in report["collectives"]:
            ops = ", ".join(f"{k}×{_n(v)}" for k, v in (c.get("ops") or {}).items())
            rows.append([c["dim"], _n(c["count"]), _n(c["bytes"]), _ms(c["time_s"]), _ms(c["exposed_s"]),
                         _ms(c["hidden_s"]), _ms(c["wait_s"]), _ms(c["transfer_s"]), ops])
        shown["collectives"] = print_table(console, "Collectives by dimension (per rank per step)", cols, rows)
    if report.get("experts"):
        cols = [Col("rank", key=True), Col("ep group", key=True),
                *(Col(h) for h in ("tokens", "x mean", "wait cost ms", "waits most for"))]
        most = _most_waited(report)
        rows = [[str(e["rank"]) + (" (hottest)" if e["hottest"] else ""), e["ep_group"], _n(e["tokens"]),
                 "-" if e["share_of_mean"] is None else f"{e['share_of_mean']:.2f}", _ms(e["wait_cost_s"]),
                 most.get(e["rank"], "-")]
                for e in report["experts"]]
        shown["experts"] = print_table(console, "Expert load (per step)", cols, rows)
    if report["stragglers"]:
        cols = [Col("rank", key=True), Col("metric", key=True), *(Col(h) for h in ("slowdown", "cost ms/step")),
                Col("evidence", wrap=True, justify="left")]
        rows = []
        for s in report["stragglers"]:
            slow = s["slowdown"]
            rows.append([str(s["rank"]), s["metric"], "-" if slow is None else f"{slow:+.1%}", _ms(s["cost_s"]),
                         s.get("evidence") or "-"])
        shown["stragglers"] = print_table(console, "Stragglers (culprit first)", cols, rows)
    else:
        console.print("No persistent straggler: no rank was late in most steps by more than the run's own "
                      "step-to-step spread.")
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(printable(w))}", highlight=False)
    print_legend(console, shown, explain)


def print_whatif(result: dict, console) -> None:
    """The what-if result (``pptrace whatif``) as terminal tables."""
    from ..whatif.predict import BY_REPLAY_ERROR, BY_STEP_TIME, BY_THROUGHPUT
    from .tables import Col, print_table

    meas, pred, rep = result["measured"], result["predicted"], result["replay"]
    basis = result.get("comparison") or BY_STEP_TIME
    error = rep.get("error_fraction")
    error_text = "-" if error is None else f"{error * 100:+.1f}%"

    def label(d):
        text = f"{d['schedule']} m={d['microbatches']}" + (f" v={d['vpp']}" if d["vpp"] > 1 else "")
        if d.get("no_straggler"):
            text += " no-straggler"
        if d.get("p2p_free"):
            text += " p2p-free"
        if d.get("balanced_experts"):
            text += " balanced-experts"
        return text

    def ms(seconds):
        return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"

    def per_mb(d, step_s):
        # a microbatch is the same samples in every configuration: time per microbatch is
        # the inverse of per-sample throughput
        return ms(step_s / d["microbatches"]) if step_s is not None and d["microbatches"] else "-"

    # export/tables.py: fits the console's width without cutting a value
    cols = [Col("", key=True, justify="left"), Col("configuration", wrap=True, justify="left"),
            *(Col(h) for h in ("step time", "per microbatch", "pipeline window")), Col("vs measured", wrap=True)]
    rows = [["measured", label(meas), ms(meas["step_time_s"]), per_mb(meas, meas["step_time_s"]),
             ms(meas["window_s"]), ""],
            ["replayed", label(meas), ms(rep["step_time_s"]), per_mb(meas, rep["step_time_s"]),
             ms(rep.get("window_s")), f"error {error_text}"]]
    if basis != BY_REPLAY_ERROR:
        ratio = result.get("throughput_ratio") if basis == BY_THROUGHPUT else result.get("step_time_ratio")
        versus = "-" if ratio is None else ("throughput" if basis == BY_THROUGHPUT else "speedup") + f" {ratio:.2f}x"
        rows.append(["predicted", label(pred), ms(pred["step_time_s"]), per_mb(pred, pred["step_time_s"]),
                     ms(pred["window_s"]), versus])
    print_table(console, "what-if", cols, rows, show_edge=False)
    rows = [[str(s["stage"]), ms(s["compute_s"]), ms(s["transfer_s"]), ms(s["bubble_s"]),
             f"{s['bubble_fraction'] * 100:.1f}"] for s in pred["stages"]]
    print_table(console, "replayed stages" if basis == BY_REPLAY_ERROR else "predicted stages",
                [Col("stage", key=True), *(Col(h) for h in ("compute", "transfer", "bubble", "bubble %"))],
                rows, show_edge=False)
    if basis == BY_REPLAY_ERROR:
        console.print(f"nothing changed: the replay of the measured configuration is {error_text} off the "
                      "measured step, the error to expect of a prediction from this run (no speedup)")
    elif basis == BY_THROUGHPUT:
        throughput = result.get("throughput_ratio")
        if throughput is not None:
            console.print(f"predicted per-sample throughput: {throughput:.2f}x the measured with "
                          f"{pred['microbatches']} microbatches instead of {meas['microbatches']} "
                          f"(a step of {pred['microbatches']}/{meas['microbatches']} the samples in "
                          f"{pred['step_time_s'] / meas['step_time_s']:.2f}x the time); replay error {error_text}")
    elif result.get("speedup") is not None:
        console.print(f"predicted speedup: {result['speedup']:.2f}x (step time; replay error {error_text})")
    for note in result.get("notes", []):
        console.print(f"note: {note}")
