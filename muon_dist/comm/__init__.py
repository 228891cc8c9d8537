"""Process groups from the parameters' meshes, the packed exchange, rank agreement."""
