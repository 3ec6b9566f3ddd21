"""siftpipe's tests, one folder per layer of the package (tests/core mirrors siftpipe/core, ...);
the helpers tests share are modules of this package: common, contract, faults, s3util, tally."""
