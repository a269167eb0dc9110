"""What a person runs around the stages: status, plan, the report page, plots, rehearse, the
command line."""
