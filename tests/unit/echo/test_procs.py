

def test_more_files_raises_the_soft_limit_to_the_hard_one():
    import resource

    from echo.procs import more_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        assert more_files() == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(hard, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
