def test_local_s3_survives_a_restart_on_the_same_port(own_s3):
    name = own_s3.new_bucket()
    fs = own_s3.fs()
    fs.pipe(f"{name}/a", b"x")
    port = own_s3.port
    own_s3.stop()
    own_s3.start()
    assert own_s3.port == port
    assert own_s3.fs().cat(f"{name}/a") == b"x"
