"""`megaresil plan`: the checkpoint interval and goodput a run can expect at
scale, from its own measured costs (costs.py), closed-form models (model.py)
and a discrete-event simulator of failures drawn from a profile (simulate.py)."""
