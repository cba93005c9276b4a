"""A user's helper module holding a control input (read by a test model as ``module.CONTROL``)."""

CONTROL = 0.0


def control() -> float:
    return CONTROL
