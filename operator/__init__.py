"""The RLJob operator (kopf): reconciles an RLJob into inference pools, the router and a trainer gang.

Run it with `python -m rljob.operator`; see docs/operator.md.
"""
