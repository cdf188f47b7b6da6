"""Code common to every SuperInfer service: wire protocol, configuration, logging."""
