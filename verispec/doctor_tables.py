"""`verispec doctor`'s report as rich tables, built from diagnose()'s dict; the command line prints them."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from verispec.doctor import milliseconds


def doctor_tables(report: dict) -> list[Table | Text]:
    """The machine, the formats, the choices in force, the measured costs and the expected speedup, in that order."""
    return [
        machine_table(report["machine"], report["choices"]["dtype"]),
        formats_table(report["formats"]),
        choices_table(report["choices"]),
        remembered_table(report["choices"]),
        costs_table(report["costs"], report["expectation"]),
        *(Text(f"warning: {warning}", style="yellow") for warning in report["costs"]["warnings"]),
        expectation_table(report["expectation"]),
        Text(report["expectation"]["verdict"], style="bold"),
    ]


def machine_table(machine: dict, dtype: dict) -> Table:
    table = Table("", "", title="this machine", show_header=False)
    has = [feature for feature, present in machine["isa"].items() if present]
    lacks = [feature for feature, present in machine["isa"].items() if not present]
    rows = [
        ("CPU", f"{machine['cpu']} (family/model {machine['cpu_family_model']}), kind {machine['kind']}"),
        ("cores, torch threads", f"{machine['cores']}, {machine['threads']}"),
        ("memory", f"{machine['memory_gib']} GiB"),
        ("ISA features", ", ".join(has) + (f" (no {', '.join(lacks)})" if lacks else "")),
        ("compute dtype", f"{dtype['format']}: {dtype['why']}"),
        ("software", f"torch {machine['torch']}, python {machine['python']}, "
                     + f"verispec {machine['verispec_commit'] or '(installed: no git commit)'}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def formats_table(formats: dict) -> Table:
    table = Table("format", "runs here", "auto times it for", "why not", title="weight formats")
    for name, facts in formats.items():
        roles = [role for role in ("target", "draft") if facts[f"{role}_candidate"]]
        table.add_row(name, "yes" if facts["runs"] else "no", ", ".join(roles) or "-", facts["why_not"] or "")
    return table


def choices_table(choices: dict) -> Table:
    table = Table("", title="what `auto` loads here")
    for column in ("model", "format", "why"):
        table.add_column(column, overflow="fold")
    for role in ("target", "draft"):
        choice = choices[role]
        table.add_row(role, choice["model"], choice["format"], choice["why"])
    return table


def remembered_table(choices: dict) -> Table:
    title = f"choices remembered for this machine ({choices['remembered_file']})"
    table = Table("kind", "choice", "timed", "in force", title=title)
    for kept in choices["remembered"]:
        table.add_row(kept["kind"], kept["choice"], milliseconds(kept["seconds"]), "yes" if kept["in_force"] else "")
    table.caption = "delete the file to time the choices again"
    return table


def costs_table(costs: dict, expectation: dict) -> Table:
    rows = costs["rows"]
    title = (f"whole-forward cost, ms, after {costs['context']} tokens of context "
             f"(median of {costs['rounds']} interleaved rounds; * = what auto loads)")
    table = Table("model", "format", *(f"{n} tok" for n in rows), f"{rows[-1]} / 1", title=title)

    def add(model: str, label: str, seconds: dict, chosen: bool) -> None:
        cells = [f"{1000 * seconds[n]:.1f}" for n in rows]
        table.add_row(model, label + (" *" if chosen else ""), *cells, f"{seconds[rows[-1]] / seconds[rows[0]]:.2f}x")

    for label, seconds in costs["target"].items():
        add("target", label, seconds, label == expectation["target_format"])
    for label, seconds in costs["target_beside_drafts"].items():
        add("target, timed beside the drafts", label, seconds, True)
    for label, seconds in costs["draft"].items():
        add("draft", label, seconds, label == expectation["draft_format"])
    return table


def expectation_table(expectation: dict) -> Table:
    title = (f"expected speedup over plain decoding: target {expectation['target_format']}, "
             f"draft {expectation['draft_format']}")
    table = Table("draft acceptance", "best k", "speedup", title=title)
    for row in expectation["by_acceptance"]:
        table.add_row(f"{row['acceptance']:g}", str(row["best_k"]), f"{row['speedup']:.2f}x")
    if not expectation["same_vocabulary"]:
        table.caption = "the draft's tokenizer differs from the target's: the draft-model drafter refuses this pair"
    return table
