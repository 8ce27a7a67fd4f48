-- OURS: ... replicated into a table partitioned by range of the key on both targets (one row moves between
-- partitions on an UPDATE of the key)
CREATE TABLE measurements (id int PRIMARY KEY, region text NOT NULL, v numeric) PARTITION BY RANGE (id);
CREATE TABLE measurements_low PARTITION OF measurements FOR VALUES FROM (MINVALUE) TO (1000);
CREATE TABLE measurements_high PARTITION OF measurements FOR VALUES FROM (1000) TO (MAXVALUE);
