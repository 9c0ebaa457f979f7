"""The end of a finished run, recorded (the seed's closure and cleanup): `ledger` counts the collectives each
process issues while it runs, `record` stops what the run started, measures what is left and commits the closure
receipt. Used by the launcher only; `evidence/closure_check.py` is what `verify` checks of it."""
