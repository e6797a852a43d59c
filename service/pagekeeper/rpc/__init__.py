"""The gRPC adapter: servicer, conversions, server assembly."""
