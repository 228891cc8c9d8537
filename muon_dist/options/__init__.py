"""What a user can set: the options, their checks, and the execution settings."""
