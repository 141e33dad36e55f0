"""The online planner beside the coordinator: live load in, desired prefill and decode counts out."""
