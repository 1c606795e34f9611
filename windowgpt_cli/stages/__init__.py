"""One module per stage: a plain function that tests call, and its thin `command`."""
