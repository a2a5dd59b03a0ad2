//! GPU test cases of the intranode family (filled in below).
