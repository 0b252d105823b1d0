"""Moving bytes: ``TransferPlan`` (plan.py), the descriptor planner, and the engines."""
