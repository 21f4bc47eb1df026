"""What the operating system gives every command: logging, sd_notify, mountinfo, progress."""
