"""The shardsink services: mint, write, append (the sink) and the controller."""
