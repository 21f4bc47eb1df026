"""What the operating system gives every command (logging, sd_notify, mountinfo, progress), and
a dataset folder as a reading process maps and checks it."""
