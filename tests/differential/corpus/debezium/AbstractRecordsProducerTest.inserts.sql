-- INSERT_CASH_TYPES_STMT
INSERT INTO cash_table (csh) VALUES ('$1234.11');
-- INSERT_NEGATIVE_CASH_TYPES_STMT
INSERT INTO cash_table (csh) VALUES ('($1234.11)');
-- INSERT_DATE_TIME_TYPES_STMT
INSERT INTO time_table(ts, tsneg, ts_ms, ts_us, tz, date, date_pinf, date_ninf, ti, tip, ttf, ttz, tptz, it, ts_large, ts_large_us, ts_large_ms, tz_large, ts_max, ts_min, tz_max, tz_min, ts_pinf, ts_ninf, tz_pinf, tz_ninf, tz_zero) VALUES ('2016-11-04T13:51:30.123456'::TIMESTAMP, '1936-10-25T22:10:12.608'::TIMESTAMP, '2016-11-04T13:51:30.123456'::TIMESTAMP, '2016-11-04T13:51:30.123456'::TIMESTAMP, '2016-11-04T13:51:30.123456+02:00'::TIMESTAMPTZ, '2016-11-04'::DATE, 'infinity'::DATE, '-infinity'::DATE, '13:51:30'::TIME, '13:51:30.123'::TIME, '24:00:00'::TIME, '13:51:30.123789+02:00'::TIMETZ, '13:51:30.123+02:00'::TIMETZ, 'P1Y2M3DT4H5M6.78S'::INTERVAL,'21016-11-04T13:51:30.123456'::TIMESTAMP, '21016-11-04T13:51:30.123457'::TIMESTAMP, '21016-11-04T13:51:30.124'::TIMESTAMP,'21016-11-04T13:51:30.123456+07:00'::TIMESTAMPTZ,'294247-01-01T23:59:59.999999'::TIMESTAMP,'4713-12-31T23:59:59.999999 BC'::TIMESTAMP,'294247-01-01T23:59:59.999999+00:00'::TIMESTAMPTZ,'4714-12-31T23:59:59.999999Z BC'::TIMESTAMPTZ,'infinity'::TIMESTAMP,'-infinity'::TIMESTAMP,'infinity'::TIMESTAMPTZ,'-infinity'::TIMESTAMPTZ,'21016-11-04T13:51:30.000000+07:00'::TIMESTAMPTZ);
-- INSERT_BIN_TYPES_STMT
INSERT INTO bitbin_table (ba, bol, bol2, bs, bs7, bv1, bv, bv2, bvl, bvunlimited1, bvunlimited2) VALUES (E'\\001\\002\\003'::bytea, '0'::bit(1), '1'::bit(1), '11'::bit(2), '1'::bit(7), '1'::bit varying(1), '00'::bit(2), '000000110000001000000001'::bit(24),'1000000000000000000000000000000000000000000000000000000000000000'::bit(64), '101', '111011010001000110000001000000001');
-- INSERT_BYTEA_BINMODE_STMT
INSERT INTO bytea_binmode_table (ba, bytea_array) VALUES (E'\\001\\002\\003'::bytea, array[E'\\000\\001\\002'::bytea, E'\\003\\004\\005'::bytea]);
-- INSERT_UNKNOWN_TYPE_STMT
INSERT INTO unknown_type_table (tsq) VALUES ('fat <-> cat'::tsquery);
-- INSERT_GEOM_TYPES_STMT
INSERT INTO geom_table(p) VALUES ('(1,1)'::point);
-- INSERT_TEXT_TYPES_STMT
INSERT INTO text_table(j, jb, x, u) VALUES ('{"bar": "baz"}'::json, '{"bar": "baz"}'::jsonb, '<foo>bar</foo><foo>bar</foo>'::xml, 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::UUID);
-- INSERT_STRING_TYPES_STMT
INSERT INTO string_table (vc, vcv, ch, c, t, b, bnn, ct) VALUES ('žš', 'bb', 'cdef', 'abc', 'some text', E'\\000\\001\\002'::bytea, E'\\003\\004\\005'::bytea, 'Hello World');
-- INSERT_NETWORK_ADDRESS_TYPES_STMT
INSERT INTO network_address_table (i) VALUES ('192.168.2.0/12');
-- INSERT_CIDR_NETWORK_ADDRESS_TYPE_STMT
INSERT INTO cidr_network_address_table (i) VALUES ('192.168.100.128/25');
-- INSERT_MACADDR_TYPE_STMT
INSERT INTO macaddr_table (m) VALUES ('08:00:2b:01:02:03');
-- INSERT_NUMERIC_TYPES_STMT
INSERT INTO numeric_table (si, i, bi, r, db, r_int, db_int, r_nan, db_nan, r_pinf, db_pinf, r_ninf, db_ninf, ss, bs, b, o) VALUES (1, 123456, 1234567890123, 3.3, 4.44, 3, 4, 'NaN', 'NaN', 'Infinity', 'Infinity', '-Infinity', '-Infinity', 1, 123, true, 4000000000);
-- INSERT_NUMERIC_DECIMAL_TYPES_STMT
INSERT INTO numeric_decimal_table (d, dzs, dvs, d_nn, n, nzs, nvs, d_int, dzs_int, dvs_int, n_int, nzs_int, nvs_int, d_nan, dzs_nan, dvs_nan, n_nan, nzs_nan, nvs_nan) VALUES (1.1, 10.11, 10.1111, 3.30, 22.22, 22.2, 22.2222, 1, 10, 10, 22, 22, 22, 'NaN', 'NaN', 'NaN', 'NaN', 'NaN', 'NaN');
-- INSERT_NUMERIC_DECIMAL_TYPES_STMT_NO_NAN
INSERT INTO numeric_decimal_table (d, dzs, dvs, d_nn, n, nzs, nvs, d_int, dzs_int, dvs_int, n_int, nzs_int, nvs_int, d_nan, dzs_nan, dvs_nan, n_nan, nzs_nan, nvs_nan) VALUES (1.1, 10.11, 10.1111, 3.30, 22.22, 22.2, 22.2222, 1, 10, 10, 22, 22, 22, null, null, null, null, null, null);
-- INSERT_NUMERIC_DECIMAL_TYPES_STMT_WITH_INFINITY
INSERT INTO numeric_decimal_table (d, dzs, dvs, d_nn, n, nzs, nvs, d_int, dzs_int, dvs_int, n_int, nzs_int, nvs_int, d_nan, dzs_nan, dvs_nan, n_nan, nzs_nan, nvs_nan) VALUES (1.1, 10.11, 10.1111, 3.30, 22.22, 22.2, 22.2222, 1, 10, 10, 22, 22, 22, null, null, 'Infinity', null, null, '-Infinity');
-- INSERT_RANGE_TYPES_STMT
INSERT INTO range_table (unbounded_exclusive_tsrange, bounded_inclusive_tsrange, unbounded_exclusive_tstzrange, bounded_inclusive_tstzrange, unbounded_exclusive_daterange, bounded_exclusive_daterange, int4_number_range, numerange, int8_number_range) VALUES ('[2019-03-31 15:30:00, infinity)', '[2019-03-31 15:30:00, 2019-04-30 15:30:00]', '[2017-06-05 11:29:12.549426+00,)', '[2017-06-05 11:29:12.549426+00, 2017-06-05 12:34:56.789012+00]', '[2019-03-31, infinity)', '[2019-03-31, 2019-04-30)', '[1000,6000)', '[5.3,6.3)', '[1000000,6000000)');
-- INSERT_ARRAY_TYPES_STMT
INSERT INTO array_table (int_array, bigint_array, text_array, char_array, varchar_array, date_array, numeric_array, varnumeric_array, citext_array, inet_array, cidr_array, macaddr_array, tsrange_array, tstzrange_array, daterange_array, int4range_array, numerange_array, int8range_array, uuid_array, json_array, jsonb_array, oid_array) VALUES ('{1,2,3}', '{1550166368505037572}', '{"one","two","three"}', '{"cone","ctwo","cthree"}', '{"vcone","vctwo","vcthree"}', '{2016-11-04,2016-11-05,2016-11-06}', '{1.2,3.4,5.6}', '{1.1,2.22,3.333}', '{"four","five","six"}', '{"192.168.2.0/12","192.168.1.1","192.168.0.2/1"}', '{"192.168.100.128/25", "192.168.0.0/25", "192.168.1.0/24"}', '{"08:00:2b:01:02:03", "08-00-2b-01-02-03", "08002b:010203"}','{"[2019-03-31 15:30:00, infinity)", "[2019-03-31 15:30:00, 2019-04-30 15:30:00]"}', '{"[2017-06-05 11:29:12.549426+00,)", "[2017-06-05 11:29:12.549426+00, 2017-06-05 12:34:56.789012+00]"}', '{"[2019-03-31, infinity)", "[2019-03-31, 2019-04-30)"}', '{"[1,6)", "[1,4)"}', '{"[5.3,6.3)", "[10.0,20.0)"}', '{"[1000000,6000000)", "[5000,9000)"}', '{"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "f0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"}',array['{"bar": "baz"}','{"foo": "qux"}']::json[], array['{"bar": "baz"}','{"foo": "qux"}']::jsonb[], '{3,4000000000}');
-- INSERT_ARRAY_TYPES_WITH_NULL_VALUES_STMT
INSERT INTO array_table_with_nulls (int_array, bigint_array, text_array, date_array, numeric_array, varnumeric_array, citext_array, inet_array, cidr_array, macaddr_array, tsrange_array, tstzrange_array, daterange_array, int4range_array, numerange_array, int8range_array, uuid_array, json_array, jsonb_array) VALUES (null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null);
