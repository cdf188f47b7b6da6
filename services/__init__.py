"""The three SuperInfer services (gateway, scheduler, worker) and the `superinfer` CLI."""
