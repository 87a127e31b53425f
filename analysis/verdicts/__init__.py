"""From figures to verdicts: the comparisons with their intervals, the verdict rules and the table's rows."""
