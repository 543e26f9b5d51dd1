"""Small scripts the tests run in child processes."""
