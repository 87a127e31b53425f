"""specproxy.lab: `specproxy lab`, the whole evaluation in one command.

It is the one room that uses all the others: it starts simulated arms (engines/), drives the
workload against them (proxy/replay), paces each level to what the machine can keep up with
(:mod:`.pacing`) and prints the verdicts (analysis/). Nothing imports it but the CLI's command table.
"""
