"""The reference controller: keeps the fleet's latest topology per node and relays binding plans."""
