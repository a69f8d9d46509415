"""Inspection: ``explain`` (the plan and its cost), ``diff`` (the rewrite as code), and what they share."""
