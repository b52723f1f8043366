"""Moving tensors between stages and replicas: boundary values, device copies, links, groups, reductions."""
